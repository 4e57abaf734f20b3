"""The one table scripts/gpu_check.sh ends with: a row per check, its result and key figures.

    python scripts/gpu_summary.py OUT_DIR [--scenarios chaos/gpu]

Reads what each step left in OUT_DIR: steps.jsonl (one line per step: name, exit code, wall
time, timeout, or why it was skipped), env.json, chaos.json (`python -m chaos --summary`),
hot.json, hf.json and lightning.json (scripts/gpu_runs.py), stall_<GiB>.json
(scripts/bench_gpu.py) and cuda_oom.xml (pytest's JUnit XML). A step that left no result
reads as FAIL with its exit or timeout; a skipped step's rows as SKIP with its reason. Prints
the table (Markdown) and writes it to OUT_DIR/summary.md; exits 1 when a row is FAIL.
Standard library only: it runs after every step, whatever the host lacks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent

CHAOS_ROWS = {
    "kill": "chaos: kill -9",
    "sigstop": "chaos: SIGSTOP",
    "oom": "chaos: OOM (torch.OutOfMemoryError)",
    "nan": "chaos: NaN",
    "sigterm": "chaos: preemption (SIGTERM)",
}
"""Fault kind -> its row; every scenario of chaos/gpu/ with that kind counts in it."""
STALL_GIB = (1, 4, 16)
STALL_BLOCKED_MAX = 0.03
"""The loop's blocked time in an async save, against a synchronous save's time."""
STALL_STEP_MAX = 1.1
"""A step while the save is written in the background, against an undisturbed step."""


@dataclass
class Row:
    check: str
    result: str
    figures: str = ""

    @property
    def failed(self) -> bool:
        return self.result.startswith("FAIL")


def load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_steps(out: Path) -> dict[str, dict[str, Any]]:
    """Step name -> its line in steps.jsonl (the last one, when a step ran twice)."""
    steps: dict[str, dict[str, Any]] = {}
    path = out / "steps.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        steps[str(entry.get("step"))] = entry
    return steps


def not_run(step: dict[str, Any] | None, what: str) -> str:
    """The result of a row whose step left no result: SKIP (why) or FAIL (how it ended)."""
    if step is None:
        return "SKIP (not run)"
    if step.get("skipped"):
        return f"SKIP ({step['skipped']})"
    if step.get("timed_out"):
        return f"FAIL (timed out after {step.get('timeout_s')} s, no {what}; {step['step']}.log)"
    return f"FAIL (exit {step.get('rc')}, no {what}; {step['step']}.log)"


def transport(run_dir: str | None) -> str:
    """The training group's backend and world, from rank 0's runtime.init in a run's logs."""
    if not run_dir:
        return "?"
    for path in sorted((Path(run_dir) / "run" / "logs").glob("rank0*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") == "runtime.init":
                return f"{e.get('backend')}, {e.get('world_size')} rank(s)"
    return "?"


def scenario_kinds(scenarios: Path) -> dict[str, list[str]]:
    """Scenario name -> its fault kinds, from the TOML files."""
    kinds = {}
    for path in sorted(scenarios.glob("*.toml")):
        data = tomllib.loads(path.read_text())
        kinds[data["name"]] = [f["kind"] for f in data.get("fault", [])]
    return kinds


RECOVERY = {
    "hot": "rolled back in place",
    "retry": "retried in smaller micro-batches",
    "cold": "cold restart",
}
"""Check g's words for a recovery (chaos/check.py), as the table says them."""


def recovery(result: dict[str, Any], kind: str, index: int) -> str:
    """How the run recovered from its fault of `kind`, the scenario's `index`-th: check g's
    verdict where it has one."""
    for part in result.get("checks", {}).get("g_recovery", "").split(", "):
        if part.startswith(f"{kind}: "):
            word = part.split(" ")[1]
            return RECOVERY.get(word, word)
    if kind == "sigterm":  # b: the steps each fault lost, in order ("[3, 0] (interval 4)")
        lost = result.get("checks", {}).get("b_steps_lost", "?").split(" (")[0]
        with contextlib.suppress(ValueError, IndexError, TypeError):
            lost = str(json.loads(lost)[index])
        return f"relaunched, {lost} step(s) lost"
    return "cold restart"


def chaos_rows(out: Path, step: dict[str, Any] | None, scenarios: Path) -> list[Row]:
    kinds = scenario_kinds(scenarios)
    results = {r["scenario"]: r for r in load_json(out / "chaos.json") or []}
    rows = []
    for kind, check in CHAOS_ROWS.items():
        names = [name for name, ks in kinds.items() if kind in ks]
        if step is None or step.get("skipped") or not results:
            rows.append(Row(check, not_run(step, "result"), ", ".join(names)))
            continue
        figures, bad, skipped = [], [], []
        for name in names:
            r = results.get(name)
            if r is None:
                bad.append(f"{name}: no result, chaos.log")
                continue
            if r.get("skipped"):
                skipped.append(f"{name}: {r['skipped']}")
                continue
            if not r.get("ok") or r.get("checks", {}).get("a_bitwise_equal") != "pass":
                bad.append(f"{name}: {(r.get('failures') or ['not bitwise equal'])[0]}")
            figures.append(
                f"{name}: {recovery(r, kind, kinds[name].index(kind))}, "
                f"{r.get('wall_s', 0):.0f} s (fault-free "
                f"{r.get('golden_wall_s', 0):.0f} s), group {transport(r.get('run_dir'))}"
            )
        if bad:
            result = f"FAIL ({'; '.join(bad)})"
        elif not figures:
            result = f"SKIP ({'; '.join(skipped) or 'no scenario'})"
        else:
            result = "PASS (bitwise)"
        rows.append(Row(check, result, "; ".join(figures)))
    return rows


def run_row(check: str, data: Any, step: dict[str, Any] | None) -> Row:
    """A row from scripts/gpu_runs.py's JSON (hot, hf, lightning)."""
    if not isinstance(data, dict):
        return Row(check, not_run(step, "result"))
    if data.get("skipped"):
        return Row(check, f"SKIP ({data['skipped']})")
    fig = data.get("figures", {})
    if data.get("check") == "hot":
        figures = (
            f"hot +{fig.get('hot_extra_s')} s (formed {fig.get('hot_since_detect_s')} s "
            f"after the loss at step {fig.get('resumed_step')}, the snapshot moved in "
            f"{fig.get('snapshot_transfer_s')} s), cold +{fig.get('cold_extra_s')} s, "
            "over the fault-free run"
        )
    else:
        figures = (
            f"{fig.get('steps')} steps, resumed from step {fig.get('resumed_step')}, "
            f"+{fig.get('extra_s')} s"
        )
    figures += f"; digest {fig.get('digest')}; on {data.get('device')}, group "
    figures += str(data.get("transport"))
    if data.get("ok"):
        return Row(check, "PASS (bitwise)", figures)
    return Row(check, f"FAIL ({'; '.join(data.get('failures') or ['?'])})", figures)


def stall_row(gib: int, data: Any, step: dict[str, Any] | None) -> Row:
    check = f"async save stall, {gib} GiB"
    if not isinstance(data, dict):
        return Row(check, not_run(step, "result"))
    med = data.get("median_s", {})
    blocked, during = data.get("async_blocked_over_sync"), data.get("step_during_over_step")
    figures = (
        f"blocked/sync {blocked} (<= {STALL_BLOCKED_MAX}), step in write/step {during} "
        f"(<= {STALL_STEP_MAX}); sync {med.get('sync')} s, blocked "
        f"{med.get('async_blocked')} s, step {med.get('step')} s, "
        f"{med.get('async_steps_during')} steps in the write; {data.get('state_gib')} GiB, "
        f"{data.get('reps')} rep(s) after {data.get('warmup', 0)} warm-up save(s)"
    )
    missed = []
    if blocked is None or blocked > STALL_BLOCKED_MAX:
        missed.append(f"blocked/sync {blocked} > {STALL_BLOCKED_MAX}")
    if during is None or during > STALL_STEP_MAX:
        missed.append(f"step in write/step {during} > {STALL_STEP_MAX}")
    return Row(check, f"FAIL ({'; '.join(missed)})" if missed else "PASS", figures)


def junit_row(check: str, path: Path, step: dict[str, Any] | None) -> Row:
    try:
        cases = ET.parse(path).getroot().iter("testcase")
    except (OSError, ET.ParseError):
        return Row(check, not_run(step, "test report"))
    rows = []
    for case in cases:
        name, took = case.get("name", "?"), float(case.get("time", 0))
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skip = case.find("skipped")
        if failure is not None:
            rows.append(Row(check, f"FAIL ({(failure.get('message') or '?')[:200]})", name))
        elif skip is not None:
            rows.append(Row(check, f"SKIP ({skip.get('message')})", name))
        else:
            rows.append(Row(check, "PASS (bitwise)", f"{name}: {took:.2f} s"))
    if not rows:
        return Row(check, "FAIL (no test ran)")
    failed = [r for r in rows if r.failed]
    return failed[0] if failed else rows[0]


def env_row(out: Path, step: dict[str, Any] | None) -> Row:
    """What the checks ran on; FAIL when torch or the runtime did not import."""
    env = load_json(out / "env.json")
    if not isinstance(env, dict):
        return Row("environment", not_run(step, "env.json"))
    gpu = env.get("device") or "no CUDA device"
    if env.get("device"):
        gpu += f" ({env.get('memory_gib')} GiB, driver {env.get('driver') or '?'})"
    figures = f"{gpu}; torch {env.get('torch')} (CUDA {env.get('cuda')})"
    figures += f", Python {env.get('python')}"
    if env.get("error"):
        return Row("environment", f"FAIL ({env['error']})", figures)
    return Row("environment", "PASS", figures)


def rows(out: Path, scenarios: Path) -> list[Row]:
    steps = read_steps(out)
    table = [env_row(out, steps.get("env"))]
    table += chaos_rows(out, steps.get("chaos"), scenarios)
    table.append(run_row("hot replacement (2 ranks, one GPU)", load_json(out / "hot.json"),
                         steps.get("hot")))  # fmt: skip
    table.append(junit_row("real CUDA OOM retried", out / "cuda_oom.xml", steps.get("cuda_oom")))
    for gib in STALL_GIB:
        step = steps.get(f"stall_{gib}")
        table.append(stall_row(gib, load_json(out / f"stall_{gib}.json"), step))
    for name, check in (("hf", "HF Trainer, kill -9"), ("lightning", "Lightning, kill -9")):
        table.append(run_row(check, load_json(out / f"{name}.json"), steps.get(name)))
    return table


def cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def render(out: Path, table: list[Row]) -> str:
    steps = read_steps(out)
    took = sum(float(s.get("wall_s") or 0) for s in steps.values())
    lines = [
        f"GPU checks: {len(steps)} steps in {took:.0f} s (scripts/gpu_check.sh)",
        "",
        "| check | result | figures |",
        "|---|---|---|",
    ]
    lines += [f"| {cell(r.check)} | {cell(r.result)} | {cell(r.figures)} |" for r in table]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--scenarios", type=Path, default=REPO / "chaos" / "gpu")
    args = p.parse_args(argv)
    table = rows(args.out, args.scenarios)
    text = render(args.out, table)
    (args.out / "summary.md").write_text(text)
    print(text, end="")
    return 1 if any(r.failed for r in table) else 0


if __name__ == "__main__":
    sys.exit(main())
