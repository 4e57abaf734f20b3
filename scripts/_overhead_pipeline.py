"""The pipeline case of scripts/bench_overhead.py (`--pipeline`): the runtime's per-step
overhead on a pipelined loop, 2 CPU ranks as two 1F1B stages (torch.distributed.pipelining)
of recipes/train_nd.py's GPT (GPTStage, global names, 4 blocks), 4 micro-batches a step.

One process group, one resilient.init() (heartbeat thread on, a monitored barrier every
--barrier-every steps, no saves), each stage tracked with the ("pp",) mesh, a fixed set of
token batches. Interleaved in rounds, the order rotated every round (bench_overhead's
`interleaved`):

- bare: the plain loop: schedule.step(), optimizer step;
- again: the same plain loop once more, an A/A control (the noise floor);
- resilient: inside rt.steps() (step accounting, the preemption agreement, the barrier every
  N, the numeric check agreed over both stages, the stage-0 input and last-stage loss
  fingerprints) with rt.observe(loss=...) on the last stage.

Ratios are medians over rounds of (the variant's median step in the round / bare's in the
same round), on rank 0 (stage 0), in wall time and in process CPU time. The tracked stage's
hooks (phases, micro-batch counting, the micro-batch size check) fire in every variant; the
heartbeat thread runs during every variant; both are shares of every variant alike here, so
unlike the DDP case they are not added apart: the figures are what a user's loop sees.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["pipeline_worker", "report_pipeline"]


def pipeline_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import resilient
    from recipes.common.data import CharTokenizer
    from recipes.common.model import GPTConfig, GPTStage

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_overhead import interleaved, quartiles

    ckpt = str(Path(args.out).parent / "ckpt") if args.out else tempfile.mkdtemp()
    rt = resilient.init(
        ckpt,
        save_every_steps=None,
        save_at_end=False,
        watchdog={"barrier_every_steps": args.barrier_every},
    )
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    stage = mesh.get_local_rank("pp")
    cfg = GPTConfig(
        vocab_size=CharTokenizer().vocab_size, fused_qkv=False, tied_head=False, n_layer=4
    )
    torch.manual_seed(0)
    model = GPTStage(cfg).keep(stage, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rt.track(model=model, optimizer=opt, mesh=mesh)
    mb, t = args.batch_size // 4, cfg.block_size
    if stage == 0:
        inputs = torch.empty(mb, t, dtype=torch.long)
    else:
        inputs = torch.empty(mb, t, cfg.n_embd, requires_grad=True)
    out = torch.empty(mb, t, cfg.vocab_size if stage == 1 else cfg.n_embd, requires_grad=True)
    cpu, group = torch.device("cpu"), mesh.get_group("pp")
    sched = Schedule1F1B(
        PipelineStage(model, stage, 2, cpu, inputs, out, group=group),
        n_microbatches=4,
        loss_fn=lambda y, tgt: F.cross_entropy(y.reshape(-1, y.size(-1)), tgt.reshape(-1)),
    )
    gen = torch.Generator().manual_seed(0)  # both stages: the same batches
    batches = [
        (
            torch.randint(0, cfg.vocab_size, (args.batch_size, t), generator=gen),
            torch.randint(0, cfg.vocab_size, (args.batch_size, t), generator=gen),
        )
        for _ in range(16)
    ]

    def one(i: int, observe: bool) -> None:
        x, y = batches[i % len(batches)]
        loss = None
        if stage == 0:
            sched.step(x)
        else:
            losses: list[torch.Tensor] = []
            sched.step(target=y, losses=losses)
            loss = torch.stack(losses).mean()
        if observe:
            rt.observe(loss=loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    names = ["bare", "again", "resilient"]
    total = args.rounds * args.block + args.warmup
    steps = iter(rt.steps(total=total))
    counter = [0]

    def run_block(name: str, n: int, times: list[float], cpu: list[float]) -> None:
        for _ in range(n):
            c0, t0 = time.process_time(), time.perf_counter()
            if name == "resilient":
                next(steps)  # the previous step's end and this one's start
            one(counter[0], name == "resilient")
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            counter[0] += 1

    for name in names:
        run_block(name, args.warmup, [], [])
    dist.barrier()
    times, paired, cpu_paired = interleaved(names, args.rounds, args.block, run_block)
    for _ in steps:  # steps() ends cleanly
        pass
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    result = {
        "bench": "overhead_pipeline",
        "pipeline": "pp=2, 1F1B, 4 micro-batches",
        "ranks": dist.get_world_size(),
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "steps_per_variant": len(times["bare"]),
        "median_step_ms": {k: round(v, 3) for k, v in med.items()},
        "overhead": round(statistics.median(paired["resilient"]) - 1, 5),
        "overhead_iqr": [round(q - 1, 5) for q in quartiles(paired["resilient"])],
        "noise_again": round(statistics.median(paired["again"]) - 1, 5),
        "noise_again_iqr": [round(q - 1, 5) for q in quartiles(paired["again"])],
        "cpu_overhead": round(statistics.median(cpu_paired["resilient"]) - 1, 5),
        "cpu_noise_again": round(statistics.median(cpu_paired["again"]) - 1, 5),
    }
    if rt.rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(result))
    rt.close()


def report_pipeline(r: dict[str, Any]) -> None:
    ms = r["median_step_ms"]
    print(
        f"\n{r['pipeline']} on {r['ranks']} CPU ranks, GPTStage of 4 blocks, batch "
        f"{r['batch_size']}, {r['steps_per_variant']} timed steps per variant "
        f"({r['rounds']} interleaved rounds)"
    )
    for name in ("bare", "again", "resilient"):
        print(f"{name:10} median step {ms[name]:9.2f} ms")
    lo, hi = r["noise_again_iqr"]
    olo, ohi = r["overhead_iqr"]
    print(f"resilient over bare, wall (paired): {r['overhead']:+.3%} (IQR {olo:+.2%}..{ohi:+.2%})")
    print(f"A/A noise floor (again vs bare): {r['noise_again']:+.3%}, IQR {lo:+.2%}..{hi:+.2%}")
    print(f"CPU time per step: resilient {r['cpu_overhead']:+.3%}, A/A {r['cpu_noise_again']:+.3%}")
    print(json.dumps(r))
