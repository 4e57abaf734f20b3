"""A soak's results as a Markdown summary: per fault kind, how often it ran and passed, the
steps lost, and the time the faulty runs took beside the fault-free ones.

    python -m chaos summary chaos-output/soak-2026.json
"""

from __future__ import annotations

import collections
import json
import re
import statistics
from pathlib import Path
from typing import Any

from chaos.draw import generate
from chaos.scenario import Scenario

__all__ = ["summarize"]

_SOAK_NAME = re.compile(r"^soak-(-?\d+)-(\d+)$")


def _scenarios(names: list[str]) -> dict[str, Scenario]:
    """Regenerate soak scenarios from their names (soak-<seed>-<index>)."""
    by_seed: dict[int, int] = {}
    for name in names:
        m = _SOAK_NAME.match(name)
        if m:
            seed, i = int(m.group(1)), int(m.group(2))
            by_seed[seed] = max(by_seed.get(seed, 0), i + 1)
    return {sc.name: sc for seed, n in by_seed.items() for sc in generate(seed, n)}


def _lost(result: dict[str, Any]) -> list[int | None]:
    m = re.match(r"\[(.*?)\]", result.get("checks", {}).get("b_steps_lost", ""))
    if not m or not m.group(1).strip():
        return []
    return [None if x.strip() == "None" else int(x) for x in m.group(1).split(",")]


def summarize(results: list[dict[str, Any]]) -> str:
    scenarios = _scenarios([r["scenario"] for r in results])
    ran = [r for r in results if not r.get("skipped")]
    passed = [r for r in ran if r["ok"]]
    lines = [
        f"{len(results)} scenarios: {len(passed)} passed, {len(ran) - len(passed)} failed, "
        f"{len(results) - len(ran)} skipped.",
    ]
    for mode, hot in (("cold", False), ("hot", True)):
        runs = [r for r in results if bool(r.get("hot")) == hot]
        ok = sum(1 for r in runs if r["ok"] and not r.get("skipped"))
        skip = sum(1 for r in runs if r.get("skipped"))
        lines.append(
            f"{mode.capitalize()} mode: {len(runs)} runs, {ok} passed, "
            f"{len(runs) - ok - skip} failed, {skip} skipped."
        )
    recoveries: collections.Counter[str] = collections.Counter()
    for r in ran:  # check (g): "raise: hot (expected hot), oom: retry (expected retry)"
        for item in r.get("checks", {}).get("g_recovery", "").split(", "):
            if ": " in item:
                recoveries[item.split(": ", 1)[1].split(" (")[0]] += 1
    if recoveries:
        lines.append(
            "Recoveries seen (hot runs, numerical faults): "
            + ", ".join(f"{n} {k}" for k, n in sorted(recoveries.items()))
            + "."
        )
    lines += [
        "",
        "| fault kind | faults | in failed runs | steps lost: median | max | over one interval |",
        "|---|---|---|---|---|---|",
    ]
    per_kind: dict[str, list[tuple[int | None, bool, int]]] = collections.defaultdict(list)
    for r in ran:
        sc = scenarios.get(r["scenario"])
        interval = r.get("save_every") or (sc.save_every if sc else 0)
        mode = "hot" if r.get("hot") else ""
        for fault, lost in zip(r.get("faults", []), _lost(r), strict=False):
            key = f"{fault['kind']}` ({mode})" if mode else f"{fault['kind']}`"
            per_kind[key].append((lost, r["ok"], interval))
    for kind in sorted(per_kind):
        rows = per_kind[kind]
        losses = [lost for lost, _, _ in rows if lost is not None]
        over = sum(1 for lost, _, iv in rows if lost is not None and lost > iv)
        lines.append(
            f"| `{kind} | {len(rows)} | {sum(1 for _, ok, _ in rows if not ok)} | "
            f"{statistics.median(losses) if losses else '-'} | {max(losses, default='-')} | "
            f"{over} |"
        )
    if ran:
        lines.append("")
        for mode, hot in (("cold", False), ("hot", True)):
            ratio = [
                r["wall_s"] / r["golden_wall_s"]
                for r in ran
                if r.get("golden_wall_s") and bool(r.get("hot")) == hot
            ]
            if ratio:
                lines.append(
                    f"Wall time of a faulty run over its fault-free run ({mode}): median "
                    f"{statistics.median(ratio):.2f}, max {max(ratio):.2f}."
                )
        recipes = collections.Counter(
            (r["recipe"], r["storage"])
            if r.get("recipe")
            else (scenarios[r["scenario"]].recipe, scenarios[r["scenario"]].storage)
            for r in ran
            if r.get("recipe") or r["scenario"] in scenarios
        )
        if recipes:
            lines.append(
                "Runs by recipe and storage: "
                + ", ".join(f"{rec} on {st}: {n}" for (rec, st), n in sorted(recipes.items()))
                + "."
            )
    failed = [r for r in ran if not r["ok"]]
    if failed:
        lines += ["", "Failures:"]
        lines += [f"- {r['scenario']}: {'; '.join(r['failures'])}" for r in failed]
    return "\n".join(lines) + "\n"


def main(path: Path) -> int:
    print(summarize(json.loads(path.read_text())), end="")
    return 0
