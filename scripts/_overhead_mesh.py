"""The mesh case of scripts/bench_overhead.py (`--mesh`): the runtime's per-step overhead on a
2-D mesh, dp_shard=2 x tp=2 on 4 CPU ranks, with recipes/train_nd.py's model and layout
(FSDP2 over dp_shard, tensor parallel over tp).

One process group, one resilient.init() (heartbeat thread on, a monitored barrier every
--barrier-every steps, no saves), one model tracked with its mesh, a fixed set of token
batches per data-parallel coordinate. Interleaved in rounds, the order rotated every round:

- bare: the plain loop: forward, backward, optimizer step;
- again: the same plain loop once more, an A/A control (the noise floor);
- resilient: the recipe's loop: inside rt.steps() (step accounting, the preemption
  agreement, the barrier every N, the step fingerprint, the numeric check before the
  optimizer step, agreed over the mesh) with rt.observe(loss=...).

Ratios are medians over rounds of (the variant's median step in the round / bare's in the
same round), on rank 0, in wall time and in process CPU time (a rank waiting in a collective
or descheduled burns none). The watchdog's heartbeat thread runs during every variant (it is
per process), so its CPU share over the wall time is added to the resilient figures, as
bench_overhead.py does for DDP. The tracked model's phase hooks fire in `bare` too; they are
timed apart and added the same way. On a loaded 2-core machine 4 ranks make the side-by-side
figures noisy (the A/A line says how much), so the direct accounting is reported too: each
added piece timed on its own with the ranks in step, over the bare step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["mesh_worker", "report_mesh"]


def mesh_worker(args: argparse.Namespace) -> None:
    import sys

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import resilient
    from recipes.common.data import CharTokenizer
    from recipes.common.model import GPT, GPTConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))  # its imports
    # scripts/ is on the path: bench_overhead launched this worker
    from bench_overhead import interleaved, quartiles

    from recipes.train_nd import MESH_DIMS, parallelize

    ckpt = str(Path(args.out).parent / "ckpt") if args.out else tempfile.mkdtemp()
    rt = resilient.init(
        ckpt,
        save_every_steps=None,
        save_at_end=False,
        watchdog={"barrier_every_steps": args.barrier_every},
    )
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=MESH_DIMS)
    dp_rank = mesh.get_local_rank("dp_shard")
    cfg = GPTConfig(vocab_size=CharTokenizer().vocab_size, fused_qkv=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    parallelize(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rt.track(model=model, optimizer=opt, mesh=mesh)
    gen = torch.Generator().manual_seed(dp_rank)  # tp peers: the same batches
    batches = [
        (
            torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size), generator=gen),
            torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size), generator=gen),
        )
        for _ in range(16)
    ]
    torch.manual_seed(1 + dp_rank)

    def bare(i: int) -> None:
        x, y = batches[i % len(batches)]
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def observed(i: int) -> None:
        x, y = batches[i % len(batches)]
        _, loss = model(x, y)
        loss.backward()
        rt.observe(loss=loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    boundary: list[float] = []

    def timed_next() -> None:
        t0 = time.perf_counter()
        next(steps)
        boundary.append(time.perf_counter() - t0)

    names = ["bare", "again", "resilient"]
    total = args.rounds * args.block + args.warmup
    steps = iter(rt.steps(total=total))
    counter = [0]

    def run_block(name: str, n: int, times: list[float], cpu: list[float]) -> None:
        for _ in range(n):
            c0, t0 = time.process_time(), time.perf_counter()
            if name == "resilient":
                timed_next()  # the previous step's end and this one's start: timed
                observed(counter[0])
            else:
                bare(counter[0])
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            counter[0] += 1

    for name in names:
        run_block(name, args.warmup, [], [])
    boundary.clear()
    dist.barrier()
    wall0, cpu0 = time.perf_counter(), rt.watchdog.cpu_s
    times, paired, cpu_paired = interleaved(names, args.rounds, args.block, run_block)
    thread_cpu = rt.watchdog.cpu_s - cpu0
    wall = time.perf_counter() - wall0
    for _ in steps:  # steps() ends cleanly
        pass
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    # the phase hooks, which fire in every variant (the model is tracked): events x cost
    progress = rt.watchdog.progress
    seq0 = progress.seq
    bare(0)
    events_per_step = progress.seq - seq0
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        progress.tick()
    hook_ms = (time.perf_counter() - t0) / n * events_per_step * 1000
    extra = thread_cpu / wall + hook_ms / med["bare"]

    # direct accounting, each added piece timed on its own with the four ranks in step: the
    # step boundary as the loop saw it (bookkeeping, the preemption agreement, the barrier
    # every N, the numeric check's end of step), the pre-step numeric check over the mesh
    # (its gradient screen and agreement), the step fingerprint and rt.observe
    def per_call(fn: Any, n: int = 100) -> float:
        dist.barrier()
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    x0, y0 = batches[0]
    _, loss0 = model(x0, y0)
    loss0.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    numeric, fp, big = rt.numeric, rt._fp, [10**9]

    def numeric_check() -> None:
        big[0] += 1
        numeric.begin(big[0])
        numeric.observe_loss(loss0)
        numeric._check(grads=grads, phase="optimizer")
        numeric.end_step()

    def fingerprint() -> None:
        big[0] += 1
        fp.begin(big[0])
        fp.inputs(x0, y0)
        fp.observe_loss(loss0)
        fp.end(big[0])

    numeric_ms = per_call(numeric_check) * 1000
    fingerprint_ms = per_call(fingerprint) * 1000
    opt.zero_grad(set_to_none=True)
    boundary_ms = statistics.fmean(boundary) * 1000
    direct = (boundary_ms + numeric_ms + fingerprint_ms) / med["bare"] + extra
    result = {
        "bench": "overhead_mesh",
        "mesh": "dp_shard=2 x tp=2",
        "ranks": dist.get_world_size(),
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "steps_per_variant": len(times["bare"]),
        "median_step_ms": {k: round(v, 3) for k, v in med.items()},
        "overhead": round(statistics.median(paired["resilient"]) - 1 + extra, 5),
        "overhead_paired": round(statistics.median(paired["resilient"]) - 1, 5),
        "noise_again": round(statistics.median(paired["again"]) - 1, 5),
        "noise_again_iqr": [round(q - 1, 5) for q in quartiles(paired["again"])],
        "overhead_iqr": [round(q - 1, 5) for q in quartiles(paired["resilient"])],
        "cpu_overhead": round(statistics.median(cpu_paired["resilient"]) - 1 + extra, 5),
        "cpu_noise_again": round(statistics.median(cpu_paired["again"]) - 1, 5),
        "direct_overhead": round(direct, 6),
        "boundary_seen_ms": round(boundary_ms, 4),
        "boundary_seen_median_ms": round(statistics.median(boundary) * 1000, 4),
        "numeric_check_ms": round(numeric_ms, 4),
        "fingerprint_ms": round(fingerprint_ms, 4),
        "watchdog_thread_cpu_fraction": round(thread_cpu / wall, 6),
        "phase_bookkeeping_fraction": round(hook_ms / med["bare"], 6),
    }
    if rt.rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(result))
    rt.close()


def report_mesh(r: dict[str, Any]) -> None:
    ms = r["median_step_ms"]
    print(
        f"\n{r['mesh']} on {r['ranks']} CPU ranks, train_nd's GPT, batch {r['batch_size']}, "
        f"{r['steps_per_variant']} timed steps per variant ({r['rounds']} interleaved rounds)"
    )
    for name in ("bare", "again", "resilient"):
        print(f"{name:10} median step {ms[name]:9.2f} ms")
    lo, hi = r["noise_again_iqr"]
    olo, ohi = r["overhead_iqr"]
    print(
        f"resilient over bare, wall (paired, + thread + hooks): {r['overhead']:+.3%} "
        f"(paired alone {r['overhead_paired']:+.3%}, IQR {olo:+.2%}..{ohi:+.2%})"
    )
    print(f"A/A noise floor (again vs bare): {r['noise_again']:+.3%}, IQR {lo:+.2%}..{hi:+.2%}")
    print(f"CPU time per step: resilient {r['cpu_overhead']:+.3%}, A/A {r['cpu_noise_again']:+.3%}")
    print(
        f"direct (added work / bare step): step boundary as seen {r['boundary_seen_ms']:.3f} "
        f"ms, numeric check over the mesh {r['numeric_check_ms']:.3f} ms, fingerprint "
        f"{r['fingerprint_ms']:.4f} ms, + thread + hooks -> {r['direct_overhead']:+.3%}"
    )
    print(json.dumps(r))
