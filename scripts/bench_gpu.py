"""GPU checkpoint benchmark: how long a save stalls a CUDA training loop, async against sync.

    python scripts/bench_gpu.py                 # about 1.5 GiB of state, 5 repetitions
    python scripts/bench_gpu.py --layers 4 --reps 3
    python scripts/bench_gpu.py --state-gib 16 --reps 1 --no-torch-save --json stall_16.json

Needs one CUDA device; launches itself under torchrun with 1 rank (so the training group is
"cpu:gloo,cuda:nccl", as in a real job) unless already inside torchrun. The state is a stack
of nn.Linear(width, width) on cuda:0 with its AdamW state; `--state-gib` picks the number of
layers for about that much (parameters and AdamW's two moments: 12 bytes a weight). In each
repetition, in a rotated order, every output deleted before the next variant (a 16 GiB
state's checkpoints would not fit twice on a small disk):

- steps: 5 training steps with no save (each synchronized), the baseline step time;
- torch_save: the state dict copied to CPU and torch.save'd + fsync'd on the loop (what a
  hand-written loop does; `--no-torch-save` leaves it out);
- sync: CheckpointManager.save(blocking=True): staged, written, verified, committed;
- async: CheckpointManager.save() then training steps until the save committed, fenced as
  the manager fences them (an optimizer pre-step hook calling wait_staged(), timed here).
  `blocked` is the time the loop spent inside save() and the fence: the stall a user sees.
  `step_during` is the median step while the save is written in the background, its fence
  wait left out: what the background write costs each step. The staging copies device
  tensors into pinned host memory with non-blocking copies; the first async save allocates
  that memory (`--warmup N`: N untimed async saves first, as in a run past its first save;
  before torch 2.13 every save allocates it anew).

Printed as one JSON line (and written to `--json`): medians over repetitions, and the ratios
async_blocked/sync (target <= 0.03), async_blocked/step and step_during/step (target <= 1.1).
Results go to docs/benchmarks.md with the device and torch they ran on. `--cpu` runs the same
on the CPU, a smoke test of this script where no GPU is (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


STATE_BYTES_PER_WEIGHT = 12
"""A float32 weight, and AdamW's exp_avg and exp_avg_sq of it: what a checkpoint holds."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument(
        "--state-gib", type=float, default=None, help="about this much state: sets --layers"
    )
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--warmup", type=int, default=0, help="untimed async saves first (their buffers stay)"
    )
    p.add_argument("--no-async", action="store_true", help="leave the async variant out")
    p.add_argument("--no-torch-save", action="store_true", help="leave torch_save out")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the result here too")
    p.add_argument("--cpu", action="store_true", help="on the CPU: a smoke test of the script")
    args = p.parse_args()
    if args.state_gib is not None:
        args.layers = layers_for(args.state_gib, args.width)
    return args


def layers_for(gib: float, width: int) -> int:
    """How many Linear(width, width) layers hold about `gib` GiB of checkpointed state."""
    per_layer = STATE_BYTES_PER_WEIGHT * (width * width + width)
    return max(1, round(gib * 2**30 / per_layer))


def launch() -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.call([*cmd, __file__, *sys.argv[1:]], env=env)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clear(root: Path) -> None:
    """Delete the checkpoints under `root` (its manager has nothing in flight)."""
    for d in root.glob("step_*"):
        shutil.rmtree(d, ignore_errors=True)


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch import nn

    from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState
    from resilient.groups.groups import init_distributed, shutdown_distributed

    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device (--cpu: a smoke test on the CPU)")
    ctx = init_distributed(timeout_s=600, side_timeout_s=600)
    work = Path(tempfile.mkdtemp(prefix="bench_gpu_", dir=args.dir))
    dev = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):  # made on the device: 16 GiB initialized on a CPU take minutes
        layers += [nn.Linear(args.width, args.width, device=dev), nn.ReLU()]
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(args.batch, args.width, device=dev)
    state = TrainState(model=model, optimizer=opt)
    mgr_async = CheckpointManager(
        CheckpointConfig(url=str(work / "async"), keep_last=1, async_save=True),
        process_group=ctx.checkpoint_group,
    )
    mgr_sync = CheckpointManager(
        CheckpointConfig(url=str(work / "sync"), keep_last=1), process_group=ctx.checkpoint_group
    )
    fence = {"s": 0.0}

    def pre_step(*_: Any) -> None:
        t0 = time.perf_counter()
        mgr_async.wait_staged()
        fence["s"] += time.perf_counter() - t0

    opt.register_step_pre_hook(pre_step)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        if not args.cpu:
            torch.cuda.synchronize()

    for _ in range(3):
        step()
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    n_step = [0]

    def v_steps() -> dict[str, float | None]:
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
        return {"step": statistics.median(ts)}

    def v_torch_save() -> dict[str, float | None]:
        t0 = time.perf_counter()
        cpu = {
            "model": {k: v.cpu() for k, v in model.state_dict().items()},
            "optim": opt.state_dict(),  # torch.save moves its CUDA tensors itself
        }
        path = work / "plain.pt"
        torch.save(cpu, path)
        fsync_file(path)
        took = time.perf_counter() - t0
        path.unlink()
        return {"torch_save": took}

    def v_sync() -> dict[str, float | None]:
        n_step[0] += 1
        t0 = time.perf_counter()
        mgr_sync.save(state, n_step[0], blocking=True)
        took = time.perf_counter() - t0
        mgr_sync.wait()  # its retention, on the manager's thread
        clear(work / "sync")
        return {"sync": took}

    def v_async() -> dict[str, float | None]:
        n_step[0] += 1
        fence["s"] = 0.0
        t0 = time.perf_counter()
        mgr_async.save(state, n_step[0])
        in_save = time.perf_counter() - t0
        during = []
        while mgr_async.in_flight:
            f0, s0 = fence["s"], time.perf_counter()
            step()
            during.append(time.perf_counter() - s0 - (fence["s"] - f0))
        mgr_async.wait()
        window = time.perf_counter() - t0
        clear(work / "async")
        return {
            "async_blocked": in_save + fence["s"],
            "async_in_save": in_save,
            "async_fence": fence["s"],
            "async_window": window,
            "async_step_during": median(list(during)),
            "async_steps_during": len(during),
        }

    for _ in range(0 if args.no_async else args.warmup):
        v_async()  # the stager's pinned buffers then exist, as after a run's first save
    variants = [v_steps, *([] if args.no_torch_save else [v_torch_save]), v_sync]
    variants += [] if args.no_async else [v_async]
    runs: list[dict[str, float | None]] = []
    for rep in range(args.reps):
        row: dict[str, float | None] = {}
        order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
        for v in order:
            row.update(v())
        runs.append(row)
    mgr_async.close()
    mgr_sync.close()
    shutdown_distributed(ctx)
    shutil.rmtree(work, ignore_errors=True)
    med = {k: median([r.get(k) for r in runs]) for k in runs[0]}
    result: dict[str, Any] = {
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "state_gib": round(nbytes / 2**30, 3),
        "layers": args.layers,
        "width": args.width,
        "reps": args.reps,
        "warmup": args.warmup,
        "median_s": {k: None if v is None else round(v, 4) for k, v in med.items()},
    }

    def ratio(a: str, b: str, digits: int) -> float | None:
        num, den = med.get(a), med.get(b)
        return None if num is None or not den else round(num / den, digits)

    if not args.no_async:
        result["async_blocked_over_sync"] = ratio("async_blocked", "sync", 4)
        result["async_blocked_over_step"] = ratio("async_blocked", "step", 3)
        result["step_during_over_step"] = ratio("async_step_during", "step", 3)
    if not args.no_torch_save:
        result["sync_over_torch_save"] = ratio("sync", "torch_save", 3)
    result["runs"] = runs
    return result


def main() -> int:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        return launch()
    result = worker(args)
    print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
