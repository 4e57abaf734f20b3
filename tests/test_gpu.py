"""The CUDA paths, on a real GPU: skipped where torch sees none (CI, the CPU VM).

Run where a GPU exists with `bash scripts/gpu_check.sh` (docs/benchmarks.md#gpu says on what
they last ran; tests/test_gpu_check.py tests that script on the CPU). What only a GPU
exercises:
- a real CUDA out-of-memory error from the caching allocator, retried in smaller micro-batches
  with the CUDA RNG restored, bit for bit a run with the smaller split;
- one-rank runs on cuda:0 through the "cpu:gloo,cuda:nccl" group under kill -9, SIGSTOP, an
  injected OOM, preemption and a NaN (cold, and rolled back in place in hot mode), each
  resumed from checkpoints or snapshots of the CUDA state, ending bit for bit on the
  fault-free run's weights (chaos/gpu/*.toml; the recipes run one rank per GPU);
- a hot replacement of a lost rank with two ranks on the one GPU over gloo, its state from
  the survivor's snapshot, bit for bit the fault-free run (scripts/gpu_runs.py hot).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chaos.procs import REPO, events
from chaos.runner import run_scenario
from chaos.scenario import Scenario
from resilient.groups.groups import DistContext
from resilient.guard.guard import Guard
from resilient.hang.config import WatchdogConfig
from resilient.hang.watchdog import Watchdog

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_SCENARIOS = Path(__file__).resolve().parent.parent / "chaos" / "gpu"
SAMPLES = 8


def one_rank_guard(path: Path) -> Guard:
    ctx = DistContext(
        rank=0, world_size=1, local_rank=0, restart=0, run_id="gpu", host="h", backend=None
    )
    return Guard(Watchdog(WatchdogConfig(enabled=False), ctx, str(path)), ctx, str(path))


def guarded_step(guard: Guard, model: torch.nn.Module, x, y, scratch_per_sample: int, split=None):
    """One step whose forward also takes `scratch_per_sample` bytes of GPU memory per sample
    of its micro-batch: the activations of a model too big for the whole batch."""
    splits = []
    for mb in guard.micro_batches(x, y, model=model, split=split):
        with mb:
            if mb.index == 0:
                splits.append(mb.count)
            scratch = torch.empty(
                scratch_per_sample * len(mb.inputs[0]), dtype=torch.uint8, device="cuda"
            )
            loss = torch.nn.functional.mse_loss(model(mb.inputs[0]), mb.inputs[1])
            mb.backward(loss)
            del scratch
    return splits


@pytest.mark.timeout(120)
def test_real_cuda_oom_is_retried_bitwise_in_smaller_micro_batches(tmp_path: Path, events):
    """The whole batch needs twice the GPU's memory, half of it the whole memory: the first
    two attempts fail in the caching allocator, the third (split 4) fits. Dropout draws from
    the CUDA generator, so the retry is only bitwise if the CUDA RNG state is restored."""
    total = torch.cuda.get_device_properties(0).total_memory
    per_sample = total // (SAMPLES // 4) // 2  # split 4: half the memory; split 2: all of it
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 64, generator=gen).cuda()
    y = torch.randn(SAMPLES, 1, generator=gen).cuda()

    def model() -> torch.nn.Module:
        torch.manual_seed(3)
        torch.cuda.manual_seed(3)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.Dropout(0.3), torch.nn.Linear(256, 1)
        ).cuda()

    retried = model()
    splits = guarded_step(one_rank_guard(tmp_path / "a"), retried, x, y, per_sample)
    rng_after = torch.cuda.get_rng_state()
    reference = model()
    ref_splits = guarded_step(one_rank_guard(tmp_path / "b"), reference, x, y, per_sample, split=4)
    assert splits == [1, 2, 4] and ref_splits == [4]
    assert torch.equal(rng_after, torch.cuda.get_rng_state())
    for a, b in zip(retried.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    retries = events("oom.retry")
    assert [(e["split_from"], e["split_to"]) for e in retries] == [(1, 2), (2, 4)]
    del retried, reference
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() < total // 8  # nothing of the failed attempts is held


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", sorted(GPU_SCENARIOS.glob("*.toml")), ids=lambda p: p.stem)
def test_gpu_scenario_ends_bitwise(path: Path, tmp_path_factory):
    sc = Scenario.load(path)
    result = run_scenario(sc, tmp_path_factory.getbasetemp() / "chaos-gpu", keep=True)
    assert result.ok, f"{result.failures}\n{result.checks}\nkept in {result.run_dir}"
    assert result.checks["a_bitwise_equal"] == "pass"
    assert result.checks["e_no_leftover"] == "pass"
    # it trained on the GPU: the training group has CUDA's backend
    inits = [e for e in events(Path(result.run_dir) / "run", 0) if e["event"] == "runtime.init"]
    assert inits and all("cuda:nccl" in e["backend"] for e in inits), inits
    shutil.rmtree(result.run_dir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hot_replacement_on_one_gpu_ends_bitwise(tmp_path: Path):
    """Two ranks on cuda:0 (CUDA tensors over gloo): rank 1 SIGKILLed mid-run is replaced
    warm from the survivor's snapshot and the run ends on the fault-free digest; so does the
    same kill without hot recovery (a cold restart)."""
    out = tmp_path / "hot.json"
    cmd = [sys.executable, str(REPO / "scripts" / "gpu_runs.py"), "hot", "--work", str(tmp_path)]
    done = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=560)
    result = json.loads(out.read_text())
    assert result["ok"], f"{result['failures']}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    assert result["device"] == "cuda" and result["transport"] == "gloo, 2 rank(s)"
