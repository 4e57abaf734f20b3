"""GPU checkpoint benchmark: how long a save stalls a CUDA training loop, async against sync.

    python scripts/bench_gpu.py                 # about 1.5 GiB of state, 5 repetitions
    python scripts/bench_gpu.py --layers 4 --reps 3

Needs one CUDA device; launches itself under torchrun with 1 rank (so the training group is
"cpu:gloo,cuda:nccl", as in a real job) unless already inside torchrun. The state is a stack
of nn.Linear(width, width) on cuda:0 with its AdamW state. In each repetition, in a rotated
order, every output deleted before the next variant:

- steps: 5 training steps with no save (each synchronized), the baseline step time;
- torch_save: the state dict copied to CPU and torch.save'd + fsync'd on the loop (what a
  hand-written loop does);
- sync: CheckpointManager.save(blocking=True): staged, written, verified, committed;
- async: CheckpointManager.save() then training steps until the save committed, fenced as
  the manager fences them (an optimizer pre-step hook calling wait_staged(), timed here).
  `blocked` is the time the loop spent inside save() and the fence: the stall a user sees.
  The staging copies device tensors into pinned host memory with non-blocking copies.

Printed as one JSON line: medians over repetitions, and the ratios async_blocked/sync and
async_blocked/step. Results go to docs/benchmarks.md with the device and torch they ran on.
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


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-async", action="store_true", help="leave the async variant out")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    return p.parse_args()


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


def older_stager_shim(mgr: Any) -> bool:
    """torch 2.12 and older: DCP's DefaultStager closes its StateDictStager after every
    stage(), which empties the stager's copier table, so every stage after the first fails
    (KeyError: <class 'type'>; docs/operating.md#torch-releases). Here, in the benchmark
    only, so that the staging path can be timed on a GPU host whose torch is older than
    resilient's range, that close keeps the table and only drops the cached buffers, as 2.13
    does. True when it was needed."""
    import inspect

    from torch.distributed.checkpoint.staging import DefaultStager

    if "_state_dict_stager.close()" not in inspect.getsource(DefaultStager._stage):
        return False
    saves = mgr._saves
    if saves._stager is not None:  # it may have staged once already (its thread's start)
        saves._stager.close()
        saves._stager = None
    stager = saves._get_stager()._state_dict_stager  # a new one, its table whole
    stager.close = stager._cached_storage_mapping.clear
    return True


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch import nn

    from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState
    from resilient.groups.groups import init_distributed, shutdown_distributed

    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    ctx = init_distributed(timeout_s=600, side_timeout_s=600)
    work = Path(tempfile.mkdtemp(prefix="bench_gpu_", dir=args.dir))
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers).to(dev)
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
    shim = older_stager_shim(mgr_async)
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

    def v_steps() -> dict[str, float]:
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
        return {"step": statistics.median(ts)}

    def v_torch_save() -> dict[str, float]:
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

    def v_sync() -> dict[str, float]:
        n_step[0] += 1
        t0 = time.perf_counter()
        mgr_sync.save(state, n_step[0], blocking=True)
        return {"sync": time.perf_counter() - t0}

    def v_async() -> dict[str, float]:
        n_step[0] += 1
        fence["s"] = 0.0
        t0 = time.perf_counter()
        mgr_async.save(state, n_step[0])
        in_save = time.perf_counter() - t0
        steps = 0
        while mgr_async.in_flight:
            step()
            steps += 1
        mgr_async.wait()
        window = time.perf_counter() - t0
        return {
            "async_blocked": in_save + fence["s"],
            "async_in_save": in_save,
            "async_fence": fence["s"],
            "async_window": window,
            "async_steps_during": steps,
        }

    variants = [v_steps, v_torch_save, v_sync] + ([] if args.no_async else [v_async])
    runs: list[dict[str, float]] = []
    for rep in range(args.reps):
        row: dict[str, float] = {}
        order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
        for v in order:
            row.update(v())
        runs.append(row)
    mgr_async.close()
    mgr_sync.close()
    shutdown_distributed(ctx)
    shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "older_stager_shim": shim,
        "state_gib": round(nbytes / 2**30, 3),
        "reps": args.reps,
        "median_s": {k: round(v, 4) for k, v in med.items()},
        **(
            {}
            if args.no_async
            else {
                "async_blocked_over_sync": round(med["async_blocked"] / med["sync"], 4),
                "async_blocked_over_step": round(med["async_blocked"] / med["step"], 3),
            }
        ),
        "sync_over_torch_save": round(med["sync"] / med["torch_save"], 3),
        "runs": runs,
    }


def main() -> int:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        return launch()
    print(json.dumps(worker(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
