"""scripts/gpu_check.sh and what it calls, on the CPU: a lent GPU machine runs them once, with
minutes to spare, so a mistake there must be found here first.

- scripts/gpu_summary.py turns canned step outputs (a pass, a failure, a missed target, a
  timeout, a skip) into the table's rows and results;
- scripts/gpu_check.sh, run on a machine without CUDA, skips every CUDA step with the reason,
  exits 0 and prints the table;
- scripts/bench_gpu.py (the async save's stall) and scripts/gpu_runs.py hot (a hot replacement
  with two ranks on one device) run their real flow with `--cpu` / `--device cpu`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from chaos.procs import REPO

SCRIPTS = REPO / "scripts"


def summary_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_summary", SCRIPTS / "gpu_summary.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def table(text: str) -> dict[str, tuple[str, str]]:
    """check -> (result, figures), from the Markdown table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and cells[0] != "check":
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def step(name: str, rc: int | None = 0, **more: object) -> str:
    entry = {"step": name, "rc": rc, "wall_s": 12, "timeout_s": 80, "timed_out": False}
    return json.dumps({**entry, "skipped": None, **more})


def chaos_result(out: Path, name: str, ok: bool = True, **checks: str) -> dict[str, object]:
    run_dir = out / "work" / name
    (run_dir / "run" / "logs").mkdir(parents=True)
    init = {"event": "runtime.init", "backend": "cpu:gloo,cuda:nccl", "world_size": 1, "rank": 0}
    (run_dir / "run" / "logs" / "rank0.jsonl").write_text(json.dumps(init) + "\n")
    return {
        "scenario": name,
        "ok": ok,
        "wall_s": 41.5,
        "golden_wall_s": 12.2,
        "checks": {"a_bitwise_equal": "pass" if ok else "fail (abc)", **checks},
        "failures": [] if ok else ["a: final state differs from the fault-free run"],
        "run_dir": str(run_dir),
        "skipped": None,
    }


def canned(out: Path) -> None:
    """Every step's output as gpu_check.sh would leave it: the FSDP2 scenario failed, the
    4 GiB stall missed a target, the 16 GiB one timed out, Lightning was skipped."""
    steps = [step("env"), step("chaos", 1), step("hot"), step("cuda_oom"), step("stall_1")]
    steps += [step("stall_4"), step("stall_16", 124, timed_out=True), step("hf")]
    steps += [step("lightning")]
    (out / "steps.jsonl").write_text("\n".join(steps) + "\n")
    env = {"python": "3.12.3", "torch": "2.11.0+cu130", "cuda": "13.0", "cuda_available": True}
    env.update(device="NVIDIA H200", memory_gib=139.8, driver="580.159.04")
    (out / "env.json").write_text(json.dumps(env))
    results = [
        chaos_result(out, "gpu-ddp-faults", b_steps_lost="[3, 0] (interval 4)"),
        chaos_result(out, "gpu-ddp-stop-oom"),
        chaos_result(out, "gpu-ddp-hot", g_recovery="nan: hot (expected hot), oom: retry"),
        chaos_result(out, "gpu-fsdp-faults", ok=False),
    ]
    (out / "chaos.json").write_text(json.dumps(results))
    figures = {"digest": "0ff9aa24aad75d06", "hot_extra_s": 2.1, "cold_extra_s": 9.4}
    figures.update(hot_since_detect_s=0.43, snapshot_transfer_s=0.15, resumed_step=13)
    hot = {"check": "hot", "ok": True, "failures": [], "device": "cuda", "figures": figures}
    (out / "hot.json").write_text(json.dumps({**hot, "transport": "gloo, 2 rank(s)"}))
    (out / "cuda_oom.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="1"><testcase classname="tests.test_gpu" '
        'name="test_real_cuda_oom_is_retried_bitwise_in_smaller_micro_batches" time="0.75"/>'
        "</testsuite></testsuites>"
    )
    for gib, blocked, during in ((1, 0.012, 1.04), (4, 0.08, 1.02)):
        stall: dict[str, object] = {"state_gib": gib - 0.06, "reps": 2, "warmup": 1}
        stall["async_blocked_over_sync"] = blocked
        stall.update(step_during_over_step=during, median_s={"sync": 1.0, "step": 0.008})
        (out / f"stall_{gib}.json").write_text(json.dumps(stall))
    hf = {"check": "hf", "ok": True, "failures": [], "device": "cuda"}
    hf.update(transport="cpu:gloo,cuda:nccl, 1 rank(s)")
    hf["figures"] = {"digest": "4a3351ec", "steps": "60", "resumed_step": 20, "extra_s": 9.0}
    (out / "hf.json").write_text(json.dumps(hf))
    why = "train_lightning.py pins accelerator='cpu' and has no --device option"
    (out / "lightning.json").write_text(json.dumps({"check": "lightning", "skipped": why}))


@pytest.mark.timeout(60)
def test_the_summary_has_a_row_per_check_with_its_result(tmp_path: Path, capsys) -> None:
    canned(tmp_path)
    code = summary_module().main([str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 1  # a row failed
    assert printed == (tmp_path / "summary.md").read_text()
    rows = table(printed)
    assert list(rows) == [
        "environment",
        "chaos: kill -9",
        "chaos: SIGSTOP",
        "chaos: OOM (torch.OutOfMemoryError)",
        "chaos: NaN",
        "chaos: preemption (SIGTERM)",
        "hot replacement (2 ranks, one GPU)",
        "real CUDA OOM retried",
        "async save stall, 1 GiB",
        "async save stall, 4 GiB",
        "async save stall, 16 GiB",
        "HF Trainer, kill -9",
        "Lightning, kill -9",
    ]
    result = {check: r for check, (r, _) in rows.items()}
    figures = {check: f for check, (_, f) in rows.items()}
    assert result["environment"] == "PASS" and "NVIDIA H200" in figures["environment"]
    # the FSDP2 scenario failed: its rows (kill -9, NaN) fail, the others pass
    assert result["chaos: kill -9"].startswith("FAIL (gpu-fsdp-faults: a: final state")
    assert result["chaos: NaN"].startswith("FAIL (gpu-fsdp-faults")
    for check in ("chaos: SIGSTOP", "chaos: OOM (torch.OutOfMemoryError)"):
        assert result[check] == "PASS (bitwise)"
    assert result["chaos: preemption (SIGTERM)"] == "PASS (bitwise)"
    assert "relaunched, 0 step(s) lost" in figures["chaos: preemption (SIGTERM)"]
    assert "cpu:gloo,cuda:nccl, 1 rank(s)" in figures["chaos: SIGSTOP"]
    oom = figures["chaos: OOM (torch.OutOfMemoryError)"]
    assert "gpu-ddp-hot: retried in smaller micro-batches" in oom
    assert "gpu-ddp-stop-oom: cold restart" in oom
    assert "gpu-ddp-hot: rolled back in place" in figures["chaos: NaN"]
    assert result["hot replacement (2 ranks, one GPU)"] == "PASS (bitwise)"
    assert "hot +2.1 s" in figures["hot replacement (2 ranks, one GPU)"]
    assert "cold +9.4 s" in figures["hot replacement (2 ranks, one GPU)"]
    assert result["real CUDA OOM retried"] == "PASS (bitwise)"
    assert result["async save stall, 1 GiB"] == "PASS"
    assert "2 rep(s) after 1 warm-up save(s)" in figures["async save stall, 1 GiB"]
    assert result["async save stall, 4 GiB"] == "FAIL (blocked/sync 0.08 > 0.03)"
    assert result["async save stall, 16 GiB"].startswith("FAIL (timed out after 80 s")
    assert result["HF Trainer, kill -9"] == "PASS (bitwise)"
    assert "resumed from step 20" in figures["HF Trainer, kill -9"]
    assert result["Lightning, kill -9"].startswith("SKIP (train_lightning.py pins")


@pytest.mark.timeout(60)
def test_a_step_that_left_nothing_fails_its_rows_and_a_skipped_one_skips_them(
    tmp_path: Path, capsys
) -> None:
    lines = [step("env"), step("chaos", 137, timed_out=True), step("hot", 1)]
    lines += [step("cuda_oom", skipped="no time left of the 540 s")]
    (tmp_path / "steps.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "env.json").write_text(json.dumps({"torch": "2.11.0", "error": "ImportError: x"}))
    assert summary_module().main([str(tmp_path)]) == 1
    result = {c: r for c, (r, _) in table(capsys.readouterr().out).items()}
    assert result["environment"] == "FAIL (ImportError: x)"
    assert result["chaos: SIGSTOP"].startswith("FAIL (timed out after 80 s, no result")
    assert result["hot replacement (2 ranks, one GPU)"].startswith("FAIL (exit 1, no result")
    assert result["real CUDA OOM retried"] == "SKIP (no time left of the 540 s)"
    assert result["HF Trainer, kill -9"] == "SKIP (not run)"


@pytest.mark.timeout(90)
def test_gpu_check_on_a_machine_without_cuda_skips_every_cuda_step(tmp_path: Path) -> None:
    env = dict(os.environ)
    if torch.cuda.is_available():  # a GPU host: the same path, asked for
        env["GPU_CHECK_CUDA"] = "0"
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_check.sh"), str(out)],
        capture_output=True,
        text=True,
        timeout=80,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.endswith((out / "summary.md").read_text())
    rows = table(done.stdout)
    assert len(rows) == 13
    assert rows.pop("environment")[0] == "PASS"
    for check, (result, _) in rows.items():
        assert result.startswith("SKIP (no CUDA device"), (check, result)
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [
        "env",
        *("chaos", "hot", "cuda_oom", "stall_1", "stall_4", "stall_16", "hf", "lightning"),
    ]
    assert sum(s["timeout_s"] for s in steps) <= 540  # a lent machine's 10 minutes, and room


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_stall_benchmark_runs_its_variants(tmp_path: Path) -> None:
    out = tmp_path / "stall.json"
    cmd = [sys.executable, str(SCRIPTS / "bench_gpu.py"), "--cpu", "--width", "128"]
    cmd += ["--layers", "2", "--reps", "2", "--warmup", "1", "--no-torch-save"]
    cmd += ["--dir", str(tmp_path)]
    done = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["median_s"]) >= {"step", "sync", "async_blocked", "async_step_during"}
    assert "torch_save" not in result["median_s"]
    assert (result["reps"], result["warmup"], len(result["runs"])) == (2, 1, 2)
    for ratio in ("async_blocked_over_sync", "step_during_over_step"):
        assert result[ratio] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["stall.json"]  # its checkpoints deleted


@pytest.mark.extended  # `make soak`: three 2-rank runs, a minute and a half on two cores
@pytest.mark.timeout(400)
def test_the_hot_replacement_check_runs_its_three_runs(tmp_path: Path) -> None:
    out = tmp_path / "hot.json"
    cmd = [sys.executable, str(SCRIPTS / "gpu_runs.py"), "hot", "--device", "cpu"]
    cmd += ["--work", str(tmp_path / "work"), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=390)
    result = json.loads(out.read_text())
    assert done.returncode == 0 and result["ok"], result["failures"]
    assert result["transport"] == "gloo, 2 rank(s)"
    assert result["runs"]["hot"]["attempts"] == 1 and result["runs"]["cold"]["attempts"] == 2
    assert result["figures"]["resumed_step"] in (12, 13)  # 12: its snapshot 13 in flight
