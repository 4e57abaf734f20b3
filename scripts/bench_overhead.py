"""Runtime overhead benchmark: the bare DDP loop vs the same loop under resilient's watchdog.

    .venv/bin/python scripts/bench_overhead.py            # full run, a few minutes
    .venv/bin/python scripts/bench_overhead.py --quick    # under a minute
    .venv/bin/python scripts/bench_overhead.py --mesh     # 4 ranks, dp_shard=2 x tp=2 (issue 36)
    .venv/bin/python scripts/bench_overhead.py --pipeline # 2 ranks, two 1F1B stages (issue 37)

`--mesh` measures the recipe loop of recipes/train_nd.py on a 2-D mesh against the same loop
without the runtime instead (scripts/_overhead_mesh.py explains its variants); `--pipeline` a
2-stage 1F1B loop (scripts/_overhead_pipeline.py).

Launches itself under torchrun with 2 ranks (--standalone, a free port); scratch files go to
a temporary directory under ./bench-output/ (or --dir), removed at the end. One process group,
one resilient.init() (heartbeat thread on, monitored barrier every --barrier-every steps, no
saves), one DDP GPT model of the recipe's size and a fixed set of token batches. Interleaved
in rounds, the order rotated every round:

- bare: the plain loop: forward, backward, optimizer step;
- again: the same plain loop once more, an A/A control: its ratio to bare is the noise floor;
- guard: inside rt.steps() (step accounting, the barrier every N), the body in
  `with rt.guard():`;
- micro: as guard, the body through rt.micro_batches() (RNG snapshot; the agreement folded
  into DDP's gradient all-reduce, one reduced gradient element read after the synced
  backward, and a vote on the control group only if it is not finite).

All variants share one tracked DDP model and the heartbeat thread runs during all (it is
per process), so two costs are counted apart and added: the thread's CPU seconds over the
wall time, and the phase hooks (progress events per step x the cost of one). Ratios are
medians over rounds of (median step time of the variant's block / that of the bare block in
the same round), on rank 0: the machine's load drifts between rounds, less within one. The
last line of stdout is one JSON object with the ratios. Timings are noisy on a shared
machine: compare ratios from the same run, never absolute times across runs.
The side-by-side ratios carry the machine's noise (see the A/A line); so does the same
comparison of process CPU time per step, far less (a rank waiting in a collective or
descheduled burns none), which shows the work added rather than the waits; the direct accounting
times each added piece on its own, both ranks in step (step bookkeeping, the barrier / N,
the guard, micro_batches with its agreement as the loop pays it (the machinery timed on its
own with a backward of nothing and the agreement folded, its one-element read included, plus
the agreement as measured in the loop; the same with a vote instead is reported too), the
step fingerprint: hashing the
first forward's inputs, the observed loss, its event), over the bare step time.
Also reported: the hang monitor's CPU fraction fed 16,384 simulated ranks (no processes).
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

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds (under a minute)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of the four variants")
    p.add_argument("--block", type=int, default=None, help="steps per variant per round")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per variant first")
    p.add_argument("--barrier-every", type=int, default=20, help="monitored barrier every N")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dir", default=None, help="scratch parent (default ./bench-output/)")
    p.add_argument("--out", default=None, help="(internal) where rank 0 writes its results")
    p.add_argument("--mesh", action="store_true", help="4 ranks on dp_shard=2 x tp=2 (train_nd)")
    p.add_argument("--pipeline", action="store_true", help="2 ranks as two 1F1B stages")
    args = p.parse_args()
    args.rounds = args.rounds or (12 if args.quick else 32)
    args.block = args.block or (6 if args.quick else 8)
    return args


# ----------------------------------------------------------------------------- launcher
def launch(args: argparse.Namespace) -> int:
    parent = Path(args.dir) if args.dir else REPO / "bench-output"
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_overhead_", dir=parent))
    out = work / "result.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4" if args.mesh else "2",  # --pipeline: two stages
        __file__,
        *sys.argv[1:],
        "--out",
        str(out),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["RESILIENT_RUN_DIR"] = str(work / "run")
    try:
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, env=env)
        if rc != 0:
            return rc
        result = json.loads(out.read_text())
        if args.mesh or args.pipeline:
            from _overhead_mesh import report_mesh
            from _overhead_pipeline import report_pipeline

            result["wall_s"] = round(time.perf_counter() - t0, 1)
            (report_mesh if args.mesh else report_pipeline)(result)
            return 0
        result["monitor_cpu_fraction_16k"] = monitor_scale()
        extra = result["watchdog_thread_cpu_fraction"] + result["phase_bookkeeping_fraction"]
        for v in ("guard", "micro"):
            result[f"total_overhead_{v}"] = round(result[f"overhead_{v}"] + extra, 5)
        result["wall_s"] = round(time.perf_counter() - t0, 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(result)
    return 0


def report(r: dict[str, Any]) -> None:
    ms = r["median_step_ms"]
    print(f"\nDDP GPT, 2 CPU ranks, batch {r['batch_size']}, {r['steps_per_variant']} timed steps")
    print(f"per variant ({r['rounds']} interleaved rounds); barrier every {r['barrier_every']}")
    print(f"{'variant':8} {'median step':>12} {'overall':>9} {'paired':>9}")
    for name in ("bare", "again", "guard", "micro"):
        overall = ms[name] / ms["bare"]
        key = "noise_again" if name == "again" else f"overhead_{name}"
        paired = 1 + r[key] if name != "bare" else 1.0
        print(f"{name:8} {ms[name]:>9.2f} ms {overall:>9.4f} {paired:>9.4f}")
    print(
        f"heartbeat thread: {r['watchdog_thread_cpu_fraction']:.4%} of a core "
        f"({r['watchdog_ticks']} ticks); phase hooks: {r['phase_events_per_step']} events "
        f"a step = {r['phase_bookkeeping_fraction']:.4%} of a bare step"
    )
    print(f"monitor fed 16,384 simulated ranks: {r['monitor_cpu_fraction_16k']:.4%} of a core")
    print(
        f"side by side (paired ratio - 1 + thread + hooks): guard "
        f"{r['total_overhead_guard']:+.3%}, micro {r['total_overhead_micro']:+.3%}"
    )
    print(
        f"direct (added work / bare step): step bookkeeping {r['step_bookkeeping_ms']:.4f} ms, "
        f"barrier {r['barrier_ms']:.3f} ms every {r['barrier_every']} steps, guard "
        f"{r['guard_ms']:.4f} ms, micro_batches with its agreement {r['micro_machinery_ms']:.3f} "
        f"ms -> guard {r['direct_overhead_guard']:.3%}, micro {r['direct_overhead_micro']:.3%}"
    )
    print(
        f"step fingerprint (input hash, loss, event; in the above): {r['fingerprint_ms']:.4f} "
        f"ms = {r['fingerprint_fraction']:.3%} of a bare step; larger inputs add "
        f"{r['fingerprint_hash_ms_per_mib']:.3f} ms per MiB hashed"
    )
    seen = r["boundary_seen_ms"]
    print(f"(the step boundary as seen in the loop, with every collective there: {seen} ms;")
    print(f" the control-group all-reduce calls as seen in the loop: {r['agreement_seen_ms']} ms)")
    print(
        f"micro_batches' agreement in the loop: {r['vote_in_loop_ms']:.4f} ms per step "
        f"({r['agreement_folded_steps']} steps folded into the gradient all-reduce, read "
        f"{r['fold_check_ms']:.4f} ms; {r['agreement_voted_steps']} with a vote, its wait "
        f"after the backward {r['vote_wait_ms']:.3f} ms); a vote's round trip alone "
        f"{r['vote_round_trip_ms']:.3f} ms; the machinery with a vote instead "
        f"{r['micro_voted_ms']:.3f} ms"
    )
    print(
        f"CPU time per step, side by side (process CPU, waits excluded): guard "
        f"{r['cpu_overhead_guard']:+.3%}, micro {r['cpu_overhead_micro']:+.3%}, "
        f"A/A {r['cpu_noise_again']:+.3%}"
    )
    lo, hi = r["noise_again_iqr"]
    print(
        f"A/A noise floor (again vs bare): median {r['noise_again']:+.3%}, IQR {lo:+.2%}..{hi:+.2%}"
    )
    keys = (
        "noise_again",
        "cpu_noise_again",
        "cpu_overhead_guard",
        "cpu_overhead_micro",
        "direct_overhead_guard",
        "direct_overhead_micro",
        "total_overhead_guard",
        "total_overhead_micro",
        "overhead_guard",
        "overhead_micro",
        "phase_bookkeeping_fraction",
        "fingerprint_fraction",
        "fingerprint_hash_ms_per_mib",
        "watchdog_thread_cpu_fraction",
        "monitor_cpu_fraction_16k",
        "micro_machinery_ms",
        "vote_in_loop_ms",
        "agreement_folded_steps",
        "agreement_voted_steps",
        "median_step_ms",
    )
    print(json.dumps({k: r[k] for k in keys}))


def monitor_scale(n: int = 16_384, periods: int = 30) -> float:
    """CPU fraction of HangDetector.update for n ranks polled once a second (all healthy)."""
    import numpy as np

    from resilient.hang.config import WatchdogConfig
    from resilient.hang.heartbeat import BEAT_DTYPE, HangDetector
    from resilient.hang.phases import FLAG_WARM

    clock = [0.0]
    det = HangDetector(WatchdogConfig(), range(n), clock=lambda: clock[0])
    beats = np.zeros(n, dtype=BEAT_DTYPE)
    beats["flags"] = FLAG_WARM
    cpu = 0.0
    for i in range(1, periods + 1):
        clock[0] = float(i)
        beats["beat"] = i
        beats["seq"] = 10 * i
        beats["step"] = i
        beats["phase"] = 3
        beats["age"] = 0.05
        beats["local"] = 0.02
        raw = beats.tobytes()
        size = BEAT_DTYPE.itemsize
        payloads = [raw[k * size : (k + 1) * size] for k in range(n)]
        c0 = time.process_time()
        det.update(payloads)
        cpu += time.process_time() - c0
    return round(cpu / periods, 6)


# ----------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import resilient
    from recipes.common.data import CharTokenizer
    from recipes.common.model import GPT, GPTConfig

    ckpt = str(Path(args.out).parent / "ckpt") if args.out else tempfile.mkdtemp()
    rt = resilient.init(
        ckpt,
        save_every_steps=None,
        save_at_end=False,
        watchdog={"barrier_every_steps": args.barrier_every},
    )
    cfg = GPTConfig(vocab_size=CharTokenizer().vocab_size)

    # One model for every variant: two DDP instances differ in speed by more than the
    # effect measured here (memory placement), so the variants share one. It is tracked, so
    # its phase hooks also fire in `bare`; their cost is measured apart below.
    torch.manual_seed(0)
    model = DDP(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rt.track(model=model, optimizer=opt)
    gen = torch.Generator().manual_seed(rt.rank)
    batches = [
        (
            torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size), generator=gen),
            torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size), generator=gen),
        )
        for _ in range(16)
    ]

    def bare(i: int) -> None:
        x, y = batches[i % len(batches)]
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def guarded(i: int) -> None:
        x, y = batches[i % len(batches)]
        with rt.guard():
            _, loss = model(x, y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def micro(i: int) -> None:
        x, y = batches[i % len(batches)]
        for mb in rt.micro_batches(x, y, model=model):
            with mb:
                _, loss = model(*mb.inputs)
                mb.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    total = 2 * (args.rounds * args.block + args.warmup)
    steps = iter(rt.steps(total=total))
    counter = [0]

    boundary: list[float] = []
    agree_seen: list[float] = []
    all_reduce = dist.all_reduce

    def timed_all_reduce(*a: Any, **kw: Any) -> Any:
        # the guard's agreement, as the loop sees it: its cost plus the wait for the peer
        t0 = time.perf_counter()
        out = all_reduce(*a, **kw)
        if kw.get("group") is rt.ctx.control_group:
            agree_seen.append(time.perf_counter() - t0)
        return out

    dist.all_reduce = timed_all_reduce  # type: ignore[assignment]

    # the agreement beside the backward, as the loop pays it: the vote's launch before the
    # synced backward plus the wait for it after (guard/attempt.py)
    from resilient.guard.attempt import Attempt

    vote_in_loop: list[float] = []
    vote_wait: list[float] = []
    launch, finish = Attempt.launch, Attempt.finish

    def timed_launch(self: Any, status: int) -> None:
        t0 = time.perf_counter()
        launch(self, status)
        self._bench_t = time.perf_counter() - t0

    def timed_finish(self: Any) -> None:
        t0 = time.perf_counter()
        finish(self)
        waited = time.perf_counter() - t0
        vote_wait.append(waited)
        vote_in_loop.append(getattr(self, "_bench_t", 0.0) + waited)

    # folded into the gradient all-reduce (the default here): the read of one reduced
    # gradient element after the synced backward is all the loop pays
    fold_check: list[float] = []
    gradients_finite = Attempt.gradients_finite

    def timed_check(self: Any) -> bool:
        t0 = time.perf_counter()
        ok = gradients_finite(self)
        fold_check.append(time.perf_counter() - t0)
        return ok

    Attempt.launch = timed_launch  # type: ignore[method-assign]
    Attempt.finish = timed_finish  # type: ignore[method-assign]
    Attempt.gradients_finite = timed_check  # type: ignore[method-assign]

    def run_block(
        name: str, n: int, times: list[float] | None, cpu: list[float] | None = None
    ) -> None:
        for _ in range(n):
            c0 = time.process_time()
            t0 = time.perf_counter()
            if name in ("bare", "again"):
                bare(counter[0])
            else:
                # the previous step's end (phases, the barrier every N) and this step's start
                # run when the steps() generator resumes: inside the timed interval
                next(steps)
                if times is not None:
                    boundary.append(time.perf_counter() - t0)
                (guarded if name == "guard" else micro)(counter[0])
            t1 = time.perf_counter()
            c1 = time.process_time()
            counter[0] += 1
            if times is not None:
                times.append(t1 - t0)
            if cpu is not None:
                cpu.append(c1 - c0)

    def per_call(fn: Any, n: int = 300) -> float:
        """Median seconds of fn() with both ranks in step (a collective inside waits for
        the other rank only as long as it takes to arrive, not for its compute)."""
        dist.barrier()
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    def empty_guard() -> None:
        with rt.guard():
            pass

    leaf = torch.zeros(1, requires_grad=True)

    def empty_micro() -> None:
        # the machinery and a backward of nothing. With the model's gradients there, the
        # agreement is the folded one, a one-element read; without them the read finds no
        # gradient and the ranks vote (the vote's round trip, unhidden by any backward)
        x, y = batches[0]
        # the guard's machinery only: rt.micro_batches also hashes the batch for the step
        # fingerprint, which the fingerprint line below already counts once per step
        for mb in rt.guards.micro_batches(x, y, model=model):
            with mb:
                mb.backward(leaf.sum())
        leaf.grad = None

    vote = torch.zeros(2, dtype=torch.int64)

    def vote_round_trip() -> None:
        all_reduce(vote, op=dist.ReduceOp.MAX, group=rt.ctx.control_group)

    names = ["bare", "again", "guard", "micro"]
    for name in names:
        run_block(name, args.warmup, None)
    dist.barrier()
    wall0, cpu0 = time.perf_counter(), rt.watchdog.cpu_s
    times, paired, cpu_paired = interleaved(names, args.rounds, args.block, run_block)
    wall = time.perf_counter() - wall0
    thread_cpu = rt.watchdog.cpu_s - cpu0
    for _ in steps:  # drain the generator: steps() ends cleanly
        pass
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    dist.all_reduce = all_reduce  # type: ignore[assignment]
    Attempt.launch, Attempt.finish = launch, finish  # type: ignore[method-assign]
    Attempt.gradients_finite = gradients_finite  # type: ignore[method-assign]
    # what the loop paid for the agreement per step: a vote's launch and wait where one was
    # held, the one-element read where it was folded into the gradient all-reduce
    in_loop = vote_in_loop + fold_check
    vote_loop_ms = statistics.median(in_loop) * 1000 if in_loop else 0.0
    fold_check_ms = statistics.median(fold_check) * 1000 if fold_check else 0.0
    vote_wait_ms = statistics.median(vote_wait) * 1000 if vote_wait else 0.0
    agree_seen_ms = statistics.median(agree_seen) * 1000 if agree_seen else 0.0
    # direct accounting of the added work, each piece timed on its own
    guard_ms = per_call(empty_guard) * 1000
    micro_voted_ms = per_call(empty_micro) * 1000  # no gradients yet: a vote each call
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    # folded, as the loop runs it; plus the agreement as the loop paid it (this counts the
    # one-element read twice: it costs more right after a real backward than here)
    micro_ms = per_call(empty_micro) * 1000 + vote_loop_ms
    opt.zero_grad(set_to_none=True)
    vote_rt_ms = per_call(vote_round_trip) * 1000
    boundary_ms = statistics.fmean(boundary) * 1000  # as seen, other agreements included
    wd = rt.watchdog

    def bookkeeping() -> None:
        wd.step_begin(wd.progress.step + 1)
        wd.progress.end_step()

    step_ms = per_call(bookkeeping) * 1000
    # the step fingerprint (resilient/replay/fingerprint.py): the hash of the first forward's
    # inputs, the observed loss and the step.fingerprint event, as one step pays them
    fp, fx, fy = rt._fp, *batches[0]
    fp_loss = torch.tensor(1.0)
    fp_step = [10**9]

    def fingerprint() -> None:
        fp_step[0] += 1
        fp.begin(fp_step[0])
        fp.inputs(fx, fy)
        fp.observe_loss(fp_loss)
        fp.end(fp_step[0])

    fingerprint_ms = per_call(fingerprint) * 1000
    # larger inputs (an image batch) cost in proportion to their bytes: per MiB, on this CPU
    big = torch.randn(8, 3, 128, 128)  # 1.5 MiB of float32
    hash_ms_per_mib = per_call(lambda: fp._tensor_hash(big), 50) * 1000 / 1.5
    barrier_ms = per_call(wd.barrier, 50) * 1000
    # phase bookkeeping: progress events per step (hooks, steps(), guards) x their cost
    progress = rt.watchdog.progress
    seq0 = progress.seq
    micro(0)
    events_per_step = progress.seq - seq0
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        progress.tick()
    hook_ms = (time.perf_counter() - t0) / n * events_per_step * 1000
    result = {
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "steps_per_variant": len(times["bare"]),
        "barrier_every": args.barrier_every,
        "median_step_ms": {k: round(v, 3) for k, v in med.items()},
        "noise_again": round(statistics.median(paired["again"]) - 1, 5),
        "cpu_noise_again": round(statistics.median(cpu_paired["again"]) - 1, 5),
        "cpu_overhead_guard": round(statistics.median(cpu_paired["guard"]) - 1, 5),
        "cpu_overhead_micro": round(statistics.median(cpu_paired["micro"]) - 1, 5),
        "noise_again_iqr": [round(q - 1, 5) for q in quartiles(paired["again"])],
        "overhead_guard": round(statistics.median(paired["guard"]) - 1, 5),
        "overhead_micro": round(statistics.median(paired["micro"]) - 1, 5),
        "overall_ratio_guard": round(med["guard"] / med["bare"], 5),
        "overall_ratio_micro": round(med["micro"] / med["bare"], 5),
        "watchdog_thread_cpu_fraction": round(thread_cpu / wall, 6),
        "watchdog_ticks": rt.watchdog.ticks,
        "phase_events_per_step": events_per_step,
        "phase_bookkeeping_fraction": round(hook_ms / med["bare"], 6),
        "boundary_seen_ms": round(boundary_ms, 4),
        "step_bookkeeping_ms": round(step_ms, 5),
        "fingerprint_ms": round(fingerprint_ms, 5),
        "fingerprint_fraction": round(fingerprint_ms / med["bare"], 6),
        "fingerprint_hash_ms_per_mib": round(hash_ms_per_mib, 4),
        "barrier_ms": round(barrier_ms, 4),
        "guard_ms": round(guard_ms, 4),
        "micro_machinery_ms": round(micro_ms, 4),
        "micro_voted_ms": round(micro_voted_ms, 4),
        "vote_round_trip_ms": round(vote_rt_ms, 4),
        "vote_in_loop_ms": round(vote_loop_ms, 4),
        "agreement_folded_steps": len(fold_check),
        "agreement_voted_steps": len(vote_in_loop),
        "fold_check_ms": round(fold_check_ms, 4),
        "vote_wait_ms": round(vote_wait_ms, 4),
        "agreement_seen_ms": round(agree_seen_ms, 4),
    }
    extra = result["watchdog_thread_cpu_fraction"] + result["phase_bookkeeping_fraction"]
    per_step = step_ms + fingerprint_ms + barrier_ms / args.barrier_every
    result["direct_overhead_guard"] = round((per_step + guard_ms) / med["bare"] + extra, 6)
    result["direct_overhead_micro"] = round((per_step + micro_ms) / med["bare"] + extra, 6)
    if rt.rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(result))
    rt.close()


def interleaved(
    names: list[str], rounds: int, block: int, run_block: Any
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[float]]]:
    """`rounds` rounds of one block of `block` steps per variant, the order rotated each
    round, every block started together (a barrier). Returns each variant's step times and,
    per round, each variant's median wall and CPU time over the bare block's next to it (the
    machine's load drifts: a variant is compared with the bare block of its own round).
    `names[0]` is the bare loop; `run_block(name, n, times, cpu)` runs and times n steps."""
    import torch.distributed as dist

    bare = names[0]
    times: dict[str, list[float]] = {k: [] for k in names}
    paired: dict[str, list[float]] = {k: [] for k in names[1:]}
    cpu_paired: dict[str, list[float]] = {k: [] for k in names[1:]}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        wall: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {}
        for name in order:
            dist.barrier()  # start every block together
            wall[name], cpu[name] = [], []
            run_block(name, block, wall[name], cpu[name])
            times[name] += wall[name]
        for v in paired:
            paired[v].append(statistics.median(wall[v]) / statistics.median(wall[bare]))
            cpu_paired[v].append(statistics.median(cpu[v]) / statistics.median(cpu[bare]))
    return times, paired, cpu_paired


def quartiles(xs: list[float]) -> tuple[float, float]:
    """The first and third quartiles of `xs` (both `xs[0]` for a single value)."""
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def main() -> int:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        return launch(args)
    if args.pipeline:
        from _overhead_pipeline import pipeline_worker

        pipeline_worker(args)
        return 0
    if args.mesh:
        from _overhead_mesh import mesh_worker

        mesh_worker(args)
        return 0
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
