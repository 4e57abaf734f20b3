"""What dropping a save's pages behind it costs a restart on the same host.

    .venv/bin/python scripts/profile_reload.py --layers 21 --reps 4

One process, no torch.distributed: `--layers` x Linear(2048, 2048) and its AdamW state (21
layers: about 1 GiB) saved with a blocking save, then loaded at once into a second copy of
the model, the page cache left as the save left it, as a restart on the same host would find
it. With `keep_in_page_cache` False (the default: the save drops its pages behind it) and
True, interleaved; every load is checked bitwise. Prints each pair of timings and their
medians.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState, state_digest


def _trained(layers: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 2048)).sum().backward()
    opt.step()
    return model, opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=21)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--out", default=None, help="a directory on the disk to measure")
    args = ap.parse_args()
    model, opt = _trained(args.layers, 0)
    model2, opt2 = _trained(args.layers, 1)
    saved = TrainState(model=model, optimizer=opt, rng=False)
    into = TrainState(model=model2, optimizer=opt2, rng=False)
    want = state_digest(model, opt)
    work = Path(tempfile.mkdtemp(prefix="reload-", dir=args.out))
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    try:
        for rep in range(args.reps):
            for keep in (False, True) if rep % 2 == 0 else (True, False):
                root = work / f"keep_{keep}"
                mgr = CheckpointManager(
                    CheckpointConfig(url=str(root), async_save=False, keep_in_page_cache=keep)
                )
                t0 = time.perf_counter()
                mgr.save(saved, step=1)
                mgr.close()
                save_s = time.perf_counter() - t0
                mgr = CheckpointManager(CheckpointConfig(url=str(root)))
                t0 = time.perf_counter()
                assert mgr.load_latest(into) == 1
                load_s = time.perf_counter() - t0
                mgr.close()
                assert state_digest(model2, opt2) == want, "the load is not what was saved"
                times[keep].append((save_s, load_s))
                print(f"keep_in_page_cache={keep!s:5}  save {save_s:.2f} s  load {load_s:.2f} s")
                shutil.rmtree(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for keep, t in times.items():
        print(
            f"keep_in_page_cache={keep!s:5}  median save {statistics.median(s for s, _ in t):.2f}"
            f" s, load right after {statistics.median(x for _, x in t):.2f} s"
        )


if __name__ == "__main__":
    main()
