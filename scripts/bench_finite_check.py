"""What the check for non-finite values costs a save (issue 27; resilient/checkpoint/finite.py).

    .venv/bin/python scripts/bench_finite_check.py              # 256 MiB of parameters: ~1 min
    .venv/bin/python scripts/bench_finite_check.py --mib 64     # quicker

One process. The state is a stack of transformer-shaped blocks in fp32 (width 1024: the
attention's qkv and output projections, the MLP's 4x up and down, two norms, biases) up to
`--mib` MiB of parameters, with AdamW state after one step: the check reads three times that
(parameters and both moments). Torch runs `--threads` intra-op threads (1, as under torchrun,
which sets OMP_NUM_THREADS=1).

- The check alone: `find_nonfinite` over the state dict a save builds, median of `--reps`
  (5). `finite_check_s_per_gib` is that per GiB checked. The other ways to screen the same
  tensors are timed beside it, in the same rounds in a rotated order (`methods_s_per_gib`),
  which is how the sum was chosen.
- The full async save, with and without the check: `save()` then `wait()` until committed,
  to a local directory with keep_last=1, `--save-reps` (9) pairs after one to warm up.
  Without the check means the manager's `check_agreed` replaced by a no-op for the timing
  (this script patches the name in resilient.checkpoint.manager; nothing else changes).
  Each repetition runs both back to back, in an order swapped every repetition, and
  `save_overhead` is the median over repetitions of with / without. The disk moves from
  one save to the next by more than the check costs: `check_share` (the check alone over
  the save without it) says what the ratio cannot resolve.

The last line of stdout is one JSON object. Files go under `bench-output/finite/`
(git-ignored) unless `--dir`, and are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MIB = 1 << 20
GIB = 1 << 30
WIDTH = 1024


def build(mib: int) -> tuple[Any, Any]:
    """A model of transformer-shaped blocks holding about `mib` MiB of fp32 parameters, and
    an AdamW that made one step."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    d = WIDTH
    blocks: list[nn.Module] = []
    total = 0
    while total < mib * MIB:
        block = nn.ModuleDict(
            {
                "norm1": nn.LayerNorm(d),
                "qkv": nn.Linear(d, 3 * d),
                "proj": nn.Linear(d, d),
                "norm2": nn.LayerNorm(d),
                "up": nn.Linear(d, 4 * d),
                "down": nn.Linear(4 * d, d),
            }
        )
        blocks.append(block)
        total += sum(p.numel() * 4 for p in block.parameters())
    model = nn.ModuleList(blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def interleaved(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """The median seconds of each of `fns` over `reps` rounds; each round runs every one
    once, in an order rotated by one per round, so that a change in the machine's load
    falls on all of them alike."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(ts) for n, ts in times.items()}


def methods(tensors: list[Any]) -> dict[str, Callable[[], bool]]:
    """Ways to ask "is every value finite?" of every tensor, each ending in one sync."""
    import torch

    def done(parts: list[Any]) -> bool:
        return bool(torch.isfinite(torch.stack(parts)).all())

    return {
        "sum": lambda: done([t.sum() for t in tensors]),
        "isfinite_all": lambda: bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all()),
        "aminmax": lambda: done([x for t in tensors for x in torch.aminmax(t)]),
        "dot": lambda: done([torch.dot(t.reshape(-1), t.reshape(-1)) for t in tensors]),
        "foreach_norm": lambda: done(list(torch._foreach_norm(tensors))),
        "mul0_sum": lambda: done([(t * 0).sum() for t in tensors]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="MiB of fp32 parameters")
    p.add_argument("--reps", type=int, default=5, help="rounds of the check (medians)")
    p.add_argument("--save-reps", type=int, default=9, help="pairs of saves (median ratio)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--dir", default=str(REPO / "bench-output" / "finite"))
    args = p.parse_args()

    import torch

    import resilient.checkpoint.manager as manager_module
    from resilient import log
    from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState
    from resilient.checkpoint.duplicates import fingerprints
    from resilient.checkpoint.finite import find_nonfinite
    from resilient.storage.checksum import updater

    torch.set_num_threads(args.threads)
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log.configure(run_dir=work / "run", run_id="bench", rank=0, restart=0, console_level="ERROR")
    model, opt = build(args.mib)
    state = TrainState(model=model, optimizer=opt, rng=False)
    sd = state.to_state_dict(step=0, rank=0)
    checked = [
        t
        for entry in ("model", "optim")
        for t in _tensors(sd[entry])
        if t.is_floating_point() and t.numel()
    ]
    gib = sum(t.numel() * t.element_size() for t in checked) / GIB
    print(f"{len(checked)} tensors, {gib * 1024:.0f} MiB checked, {args.threads} thread(s)")

    assert find_nonfinite(sd) == []
    candidates = methods(checked)
    for name, fn in candidates.items():
        assert fn() is True, name
    crc = updater("crc32c")
    timed = interleaved(
        {
            "find_nonfinite": lambda: find_nonfinite(sd),
            "same_name": lambda: bool(fingerprints(sd)),  # issue 37's per-key fingerprints
            "crc32c": lambda: bool(
                [crc(t.detach().reshape(-1).view(torch.uint8).numpy(), 0) for t in checked]
            ),
            **candidates,
        },
        args.reps,
    )
    check_s = timed.pop("find_nonfinite")
    same_name_s, crc_s = timed.pop("same_name"), timed.pop("crc32c")
    print(f"same-name fingerprints: {same_name_s / gib:.4f} s/GiB; crc32c {crc_s / gib:.4f} s/GiB")
    per_method = {name: round(seconds / gib, 4) for name, seconds in timed.items()}
    for name, per_gib in per_method.items():
        print(f"  {name:<14} {per_gib:.4f} s/GiB")
    print(f"find_nonfinite: {check_s:.4f} s, {check_s / gib:.4f} s/GiB")

    real = manager_module.check_agreed
    times: dict[str, list[float]] = {"with": [], "without": []}
    mgr = CheckpointManager(CheckpointConfig(url=str(work / "ckpt"), keep_last=1))
    step = 0
    try:
        for rep in range(args.save_reps + 1):  # the first round warms up, not counted
            for variant in ("with", "without") if rep % 2 else ("without", "with"):
                manager_module.check_agreed = real if variant == "with" else (lambda *_a, **_k: 0.0)
                step += 1
                t0 = time.perf_counter()
                mgr.save(state, step)
                assert mgr.wait() == step
                if rep:
                    times[variant].append(time.perf_counter() - t0)
    finally:
        manager_module.check_agreed = real
        mgr.close()
    save_with, save_without = (statistics.median(times[v]) for v in ("with", "without"))
    paired = [w / wo for w, wo in zip(times["with"], times["without"], strict=True)]
    print(f"async save: {save_with:.3f} s with the check, {save_without:.3f} s without")
    shutil.rmtree(work, ignore_errors=True)
    print(
        json.dumps(
            {
                "param_mib": args.mib,
                "checked_mib": round(gib * 1024, 1),
                "threads": args.threads,
                "reps": args.reps,
                "save_reps": args.save_reps,
                "finite_check_s": round(check_s, 4),
                "finite_check_s_per_gib": round(check_s / gib, 4),
                "same_name_s_per_gib": round(same_name_s / gib, 4),
                "crc32c_s_per_gib": round(crc_s / gib, 4),
                "methods_s_per_gib": per_method,
                "save_s": {"with": round(save_with, 4), "without": round(save_without, 4)},
                "save_s_each": {k: [round(x, 4) for x in v] for k, v in times.items()},
                "save_overhead": round(statistics.median(paired), 4),
                "check_share": round(check_s / save_without, 4),
            }
        )
    )


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


if __name__ == "__main__":
    main()
