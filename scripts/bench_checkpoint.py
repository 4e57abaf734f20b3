"""Checkpoint save benchmark: five ways to write the same training state to the same disk.

    .venv/bin/python scripts/bench_checkpoint.py            # full run, several minutes
    .venv/bin/python scripts/bench_checkpoint.py --quick    # smaller state, under a minute

Launches itself under torchrun with 2 ranks (a free port through --standalone) unless it is
already inside torchrun. The state is an FSDP2-sharded stack of nn.Linear with its AdamW
state (each rank's shard distinct). In one run, interleaved, each repetition in a rotated
order, with every output deleted before the next variant:

- torch_save: gather the full state to rank 0, then torch.save + fsync (what tutorials do,
  made durable like the others);
- dcp: plain dcp.save with DCP's default FileSystemWriter;
- sync: our CheckpointManager.save(blocking=True), manifest and commit included;
- async: our CheckpointManager.save() while real training steps run, fenced exactly as the
  runtime fences them (an optimizer step pre-hook calling wait_staged());
- dd1 / dd2: `dd if=/dev/zero bs=8M conv=fdatasync` of the same byte count, from rank 0
  alone (dd1) or half from each rank at once (dd2, as many writers as the saves have);
- steps: training steps with no save, the baseline step time.

Prints a table of medians and ratios; the last line of stdout is one JSON object with the
ratios, so runs can be compared. Timings are noisy on a shared machine: compare ratios
taken in the same run, never absolute figures across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller state, 3 repetitions")
    p.add_argument(
        "--dir",
        default=None,
        help="where checkpoints are written (a temporary directory is made inside and "
        "removed afterwards); default ./bench-output/ of the repository",
    )
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5, quick 3)")
    p.add_argument("--width", type=int, default=None, help="Linear width (default 2048/1024)")
    p.add_argument("--layers", type=int, default=None, help="Linear layers (default 12/8)")
    p.add_argument("--batch", type=int, default=None, help="rows per step per rank")
    p.add_argument("--write-threads", type=int, default=1, help="CheckpointConfig.write_threads")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the parts of a sync save: DCP without fsync, DCP and our writer with "
        "torch.save's per-record crc32 off, our writer without the manager, write_threads=2",
    )
    p.add_argument("--raw", default=None, help="write every measurement to this JSON file")
    p.add_argument("--keep", action="store_true", help="keep the working directory")
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)  # set by the launcher
    args = p.parse_args(argv)
    args.reps = args.reps or (3 if args.quick else 5)
    args.width = args.width or (1024 if args.quick else 2048)
    args.layers = args.layers or (8 if args.quick else 12)
    args.batch = args.batch or (32 if args.quick else 64)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


# ----------------------------------------------------------------------------- launcher
def launch(args: argparse.Namespace) -> int:
    """Re-run this file under torchrun with 2 ranks on a free port; clean up afterwards."""
    parent = Path(args.dir) if args.dir else REPO / "bench-output"
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=parent))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # c10d rendezvous on localhost, port chosen by the OS
        "--nproc-per-node",
        "2",
        __file__,
        *sys.argv[1:],
        "--workdir",
        str(work),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    try:
        return subprocess.call(cmd, env=env)
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


# ----------------------------------------------------------------------------- worker
def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Bench:
    """Everything one rank needs: groups, model, optimizer, the manager under test."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.distributed.fsdp import fully_shard

        from resilient import log
        from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState
        from resilient.runtime.dist import init_distributed

        self.args = args
        self.load_start = os.getloadavg()[0]  # other work on the machine skews every figure
        self.torch, self.dist = torch, dist
        self.work = Path(args.workdir)
        self.ctx = init_distributed(timeout_s=600, side_timeout_s=600)
        self.rank, self.world = self.ctx.rank, self.ctx.world_size
        self.ctrl = self.ctx.control_group
        # The manager's events (with its write/commit split) go to <work>/logs/rank<R>.jsonl.
        self.log_path = log.configure(
            run_dir=self.work, run_id="bench", rank=self.rank, restart=0, console_level="ERROR"
        )

        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(args.layers):
            layers += [nn.Linear(args.width, args.width), nn.ReLU()]
        self.model = nn.Sequential(*layers)
        for m in self.model:
            if isinstance(m, nn.Linear):
                fully_shard(m)
        fully_shard(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        g = torch.Generator().manual_seed(1 + self.rank)
        self.x = torch.randn(args.batch, args.width, generator=g)

        self.state = TrainState(model=self.model, optimizer=self.opt)
        self.ours_root = self.work / "ours"
        self.mgr = CheckpointManager(
            CheckpointConfig(
                url=str(self.ours_root),
                keep_last=1,
                async_save=True,
                write_threads=args.write_threads,
            ),
            process_group=self.ctx.checkpoint_group,
        )
        # The runtime's fence (Runtime._install_fences): an optimizer step pre-hook calling
        # wait_staged(). Timed here, because the time it blocks is time the loop is blocked.
        self.fence_s = 0.0

        def fence(*_: Any) -> None:
            t0 = time.perf_counter()
            self.mgr.wait_staged()
            self.fence_s += time.perf_counter() - t0

        self.opt.register_step_pre_hook(fence)
        self.step = 0
        for _ in range(3):  # optimizer state exists from here on; kernels are warm
            self.train_step()
        self.payload = self.state_bytes()

    # ---------------------------------------------------------------- helpers
    def barrier(self) -> None:
        self.dist.barrier(group=self.ctrl)

    def train_step(self) -> None:
        loss = self.model(self.x).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1

    def any_rank(self, flag: bool) -> bool:
        t = self.torch.tensor([int(flag)])
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.ctrl)
        return bool(t.item())

    def state_bytes(self) -> int:
        """Tensor bytes of the checkpointed state summed over ranks: the payload every variant
        writes (files add a little framing on top)."""
        sd = self.state.to_state_dict(step=0, rank=self.rank)
        n = 0

        def walk(o: Any) -> None:
            nonlocal n
            if isinstance(o, dict):
                for v in o.values():
                    walk(v)
            elif isinstance(o, self.torch.Tensor):
                local = o.to_local() if hasattr(o, "to_local") else o
                n += local.numel() * local.element_size()
            elif isinstance(o, bytes):
                n += len(o)

        walk(sd)
        t = self.torch.tensor([n], dtype=self.torch.int64)
        self.dist.all_reduce(t, group=self.ctrl)
        return int(t.item())

    def clear(self, path: Path) -> None:
        """Delete a variant's output (rank 0), then let the disk settle before the next one."""
        self.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        time.sleep(0.5)
        self.barrier()

    def cpu_now(self) -> float:
        """CPU seconds of this process (all threads) and its finished children (dd)."""
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    def sum_ranks(self, x: float) -> float:
        t = self.torch.tensor([x], dtype=self.torch.float64)
        self.dist.all_reduce(t, group=self.ctrl)
        return float(t.item())

    def check(self, mgr: Any, step: int) -> None:
        """Untimed: the checkpoint just written verifies (every file's size and crc32 against
        its manifest), so no variant of ours is fast by being wrong."""
        problems = mgr.verify(step, mgr.read_manifest(step))
        everyone: list[Any] = [None] * self.world
        self.dist.all_gather_object(everyone, problems, group=self.ctrl)
        bad = [p for ps in everyone for p in ps]
        if bad:
            raise RuntimeError(f"checkpoint of step {step} does not verify: {bad}")

    def timed(self, fn: Callable[[], Any]) -> dict[str, float]:
        """Wall time of `fn`, barrier to barrier, and the CPU time it took on all ranks."""
        self.barrier()
        c0 = self.cpu_now()
        t0 = time.perf_counter()
        fn()
        self.barrier()
        wall = time.perf_counter() - t0
        return {"seconds": wall, "cpu": self.sum_ranks(self.cpu_now() - c0)}

    # ---------------------------------------------------------------- variants
    def v_steps(self) -> dict[str, Any]:
        times = []
        c0 = self.cpu_now()
        for _ in range(8):
            t0 = time.perf_counter()
            self.train_step()
            self.any_rank(False)  # the async loop polls the same way: same cost per step
            times.append(time.perf_counter() - t0)
        return {"step_times": times, "cpu_per_step": self.sum_ranks(self.cpu_now() - c0) / 8}

    def v_torch_save(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        out = self.work / "torch_save"
        path = out / "ckpt.pt"
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)

        def run() -> None:
            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            msd = get_model_state_dict(self.model, options=opts)
            osd = get_optimizer_state_dict(self.model, self.opt, options=opts)
            if self.rank == 0:
                self.torch.save({"model": msd, "optim": osd, "step": self.step}, path)
                fd = os.open(path, os.O_RDONLY)  # durable, like every other variant
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

        r = self.timed(run)
        size = dir_bytes(out) if self.rank == 0 else 0
        self.clear(out)
        return {**r, "bytes": size}

    def v_dcp(self) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        out = self.work / "dcp"
        sd = self.state.to_state_dict(step=self.step, rank=self.rank)
        r = self.timed(
            lambda: dcp.save(sd, checkpoint_id=str(out), process_group=self.ctx.checkpoint_group)
        )
        size = dir_bytes(out) if self.rank == 0 else 0
        self.clear(out)
        return {**r, "bytes": size}

    def v_sync(self) -> dict[str, Any]:
        step = self.step
        r = self.timed(lambda: self.mgr.save(self.state, step, blocking=True))
        size = dir_bytes(self.ours_root) if self.rank == 0 else 0
        self.check(self.mgr, step)
        self.clear(self.ours_root)
        return {**r, "bytes": size, "events": self.last_commit()}

    def v_async(self) -> dict[str, Any]:
        """save() then train until every rank's save has committed.

        blocked: time in save() plus time in the fence. effective stall: wall time from
        save() to the end of the first step after which no rank has a save in flight,
        minus that many baseline steps (computed later, once the baseline is known).
        """
        self.barrier()
        self.fence_s = 0.0
        step = self.step
        c0 = self.cpu_now()
        t0 = time.perf_counter()
        self.mgr.save(self.state, step)
        in_save = time.perf_counter() - t0
        step_times = []
        while True:
            ts = time.perf_counter()
            self.train_step()
            busy = self.any_rank(self.mgr.in_flight)
            step_times.append(time.perf_counter() - ts)
            if not busy:
                break
        window = time.perf_counter() - t0
        cpu = self.sum_ranks(self.cpu_now() - c0)
        self.mgr.wait()  # raises if the save failed
        blocked = in_save + self.fence_s
        t = self.torch.tensor([blocked, in_save, self.fence_s], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.ctrl)
        size = dir_bytes(self.ours_root) if self.rank == 0 else 0
        self.check(self.mgr, step)
        self.clear(self.ours_root)
        return {
            "blocked": float(t[0]),
            "in_save": float(t[1]),
            "fence": float(t[2]),
            "window": window,
            "cpu": cpu,
            "step_times": step_times,
            "bytes": size,
            "events": self.last_commit(),
        }

    def _dd(self, path: Path, nbytes: int) -> None:
        subprocess.run(
            [
                "dd",
                "if=/dev/zero",
                f"of={path}",
                "bs=8M",
                f"count={nbytes}",
                "iflag=count_bytes",  # exactly nbytes, in 8 MiB blocks
                "conv=fdatasync",
                "status=none",
            ],
            check=True,
        )

    def v_dd1(self) -> dict[str, Any]:
        out = self.work / "dd"
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)

        def run() -> None:
            if self.rank == 0:
                self._dd(out / "dd.bin", self.payload)

        r = self.timed(run)
        self.clear(out)
        return {**r, "bytes": self.payload}

    def v_dd2(self) -> dict[str, Any]:
        out = self.work / "dd"
        out.mkdir(parents=True, exist_ok=True)
        share = self.payload // self.world + (self.payload % self.world if self.rank == 0 else 0)
        r = self.timed(lambda: self._dd(out / f"dd{self.rank}.bin", share))
        self.clear(out)
        return {**r, "bytes": self.payload}

    # ---------------------------------------------------------------- breakdown
    def _dcp_with(self, writer: Any, out: Path) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        sd = self.state.to_state_dict(step=self.step, rank=self.rank)
        r = self.timed(
            lambda: dcp.save(sd, storage_writer=writer, process_group=self.ctx.checkpoint_group)
        )
        size = dir_bytes(out) if self.rank == 0 else 0
        self.clear(out)
        return {**r, "bytes": size}

    def _no_zip_crc(self, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        # torch.save's per-record crc32 is process-global; torch.load never checks it. Turned
        # off here only to measure its cost, never in the library.
        cfg = self.torch.utils.serialization.config.save
        old, cfg.compute_crc32 = cfg.compute_crc32, False
        try:
            return fn()
        finally:
            cfg.compute_crc32 = old

    def v_dcp_nofsync(self) -> dict[str, Any]:
        from torch.distributed.checkpoint import FileSystemWriter

        out = self.work / "dcp"
        return self._dcp_with(FileSystemWriter(str(out), sync_files=False), out)

    def v_dcp_nozipcrc(self) -> dict[str, Any]:
        return self._no_zip_crc(self.v_dcp)

    def v_writer(self) -> dict[str, Any]:
        from resilient.checkpoint._dcp import _LocalWriter

        out = self.work / "writer"
        return self._dcp_with(_LocalWriter(str(out), sync_files=True), out)

    def v_writer_nozipcrc(self) -> dict[str, Any]:
        return self._no_zip_crc(self.v_writer)

    def v_sync_wt2(self) -> dict[str, Any]:
        from resilient.checkpoint import CheckpointConfig, CheckpointManager

        if not hasattr(self, "mgr2"):
            self.mgr2 = CheckpointManager(
                CheckpointConfig(url=str(self.work / "ours2"), keep_last=1, write_threads=2),
                process_group=self.ctx.checkpoint_group,
            )
        step = self.step
        r = self.timed(lambda: self.mgr2.save(self.state, step, blocking=True))
        size = dir_bytes(self.work / "ours2") if self.rank == 0 else 0
        self.check(self.mgr2, step)
        self.clear(self.work / "ours2")
        return {**r, "bytes": size}

    # ---------------------------------------------------------------- the run
    def run(self) -> dict[str, list[dict[str, Any]]]:
        # async first in repetition 0: its first save is the run's first save, cold.
        variants = ["async", "sync", "dcp", "torch_save", "dd1", "dd2", "steps"]
        if self.args.breakdown:
            variants += BREAKDOWN
        results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for rep in range(self.args.reps):
            order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
            for name in order:
                r = getattr(self, f"v_{name}")()
                results[name].append(r)
            if self.rank == 0:
                print(f"# repetition {rep + 1}/{self.args.reps} done", file=sys.stderr, flush=True)
        return results

    def last_commit(self) -> dict[str, Any]:
        """The manager's own split of its last save (rank 0's event log): DCP write, commit."""
        if self.log_path is None or not self.log_path.exists():
            return {}
        from resilient.events import CKPT_SAVE_COMMITTED, latest_event

        e = latest_event(self.log_path, CKPT_SAVE_COMMITTED) or {}
        return {k: e[k] for k in ("seconds", "write_s", "commit_s") if k in e}


BREAKDOWN = ["dcp_nofsync", "dcp_nozipcrc", "writer", "writer_nozipcrc", "sync_wt2"]
BREAKDOWN_LABELS = {
    "dcp_nofsync": "  dcp.save, sync_files=False",
    "dcp_nozipcrc": "  dcp.save, no torch.save crc32",
    "writer": "  dcp.save + our crc32 writer",
    "writer_nozipcrc": "  our writer, no torch.save crc32",
    "sync_wt2": "  ours, sync, write_threads=2",
}


def report(b: Bench, res: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians, ratios, a table on stdout; returns the JSON summary."""
    import torch

    args = b.args
    payload = b.payload
    base_steps = [t for r in res["steps"] for t in r["step_times"]]
    base = median(base_steps)
    base_cpu = median([r["cpu_per_step"] for r in res["steps"]])
    timed = ["dd1", "dd2", "torch_save", "dcp", "sync", *(BREAKDOWN if args.breakdown else [])]
    med = {k: median([r["seconds"] for r in res[k]]) for k in timed}
    cpu = {k: median([r["cpu"] for r in res[k]]) for k in timed}
    asy = res["async"]
    blocked = [r["blocked"] for r in asy]
    stalls = [r["window"] - len(r["step_times"]) * base for r in asy]
    extra_cpu = [r["cpu"] - len(r["step_times"]) * base_cpu for r in asy]
    during = [t for r in asy for t in r["step_times"]]
    # The disk's raw rate is dd2: two writers at once, as many as the saves have (on this
    # machine one dd stream is CPU-bound at about half the rate). dd1 is shown too.
    dd = med["dd2"]

    lines = [
        f"state: FSDP2 {args.layers} x Linear({args.width}, {args.width}) + AdamW on "
        f"{b.world} ranks, {payload / MIB:.1f} MiB ({payload} bytes); {args.reps} repetitions; "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs; load average at start "
        f"{b.load_start:.2f}, at end {os.getloadavg()[0]:.2f} (1 min)",
        "seconds: median (min..max), wall time barrier to barrier; CPU: median CPU seconds, "
        "both ranks; x dd2 = dd2 time / variant time",
        f"{'variant':<34}{'seconds':>24}{'GB/s':>7}{'CPU s':>7}{'x dd2':>7}{'x dd1':>7}",
    ]
    labels = {
        "dd1": "dd conv=fdatasync, 1 stream",
        "dd2": "dd conv=fdatasync, 2 streams",
        "torch_save": "gather to rank 0 + torch.save",
        "dcp": "plain dcp.save",
        "sync": "ours, sync save",
        **BREAKDOWN_LABELS,
    }
    for k in timed:
        v = [r["seconds"] for r in res[k]]
        rng = f"{med[k]:.3f} ({min(v):.3f}..{max(v):.3f})"
        lines.append(
            f"{labels[k]:<34}{rng:>24}{payload / med[k] / 1e9:>7.2f}{cpu[k]:>7.2f}"
            f"{dd / med[k]:>7.2f}{med['dd1'] / med[k]:>7.2f}"
        )
    for what, rs in (("sync", res["sync"]), ("async", asy)):
        ev = [r["events"] for r in rs if r["events"]]
        if ev:  # rank 0's own events: from staged to written, then manifest + commit
            lines.append(
                f"ours, {what}, rank 0's own split: dcp.save "
                f"{median([e['write_s'] for e in ev]):.3f} s, manifest+commit "
                f"{median([e['commit_s'] for e in ev]):.3f} s, save() to committed "
                f"{median([e['seconds'] for e in ev]):.3f} s"
            )
    q = statistics.quantiles(base_steps, n=4) if len(base_steps) > 1 else [base] * 3
    lines += [
        "",
        f"baseline step: {base * 1e3:.1f} ms (median of {len(base_steps)}, quartiles "
        f"{q[0] * 1e3:.1f}..{q[2] * 1e3:.1f}), {base_cpu:.2f} CPU s (both ranks)",
        f"async save: loop blocked first {blocked[0]:.4f} s, median {median(blocked):.4f} s "
        f"(in save() {median([r['in_save'] for r in asy]):.4f}, in the fence "
        f"{median([r['fence'] for r in asy]):.4f})",
        f"  save() until no rank has it in flight: {median([r['window'] for r in asy]):.3f} s, "
        f"{median([len(r['step_times']) for r in asy]):.0f} step(s) ran meanwhile: "
        f"{median(during) * 1e3:.1f} ms median, {max(during) * 1e3:.1f} ms max",
        f"  effective stall (that time - steps x baseline step): median {median(stalls):.3f} s "
        f"(min {min(stalls):.3f}, max {max(stalls):.3f}); extra CPU {median(extra_cpu):.2f} s",
    ]
    summary: dict[str, Any] = {
        "async_blocked_over_sync_dcp": median(blocked) / med["dcp"],
        "async_first_blocked_over_sync_dcp": blocked[0] / med["dcp"],
        "effective_stall_over_sync": median(stalls) / med["sync"],
        "effective_stall_over_sync_dcp": median(stalls) / med["dcp"],
        "sync_throughput_over_dd": dd / med["sync"],
        "sync_throughput_over_dd1": med["dd1"] / med["sync"],
        "dcp_over_dd": dd / med["dcp"],
        "torch_save_over_dd": dd / med["torch_save"],
        "dd_baseline": "dd2",
        "bytes": payload,
        "reps": args.reps,
        "load_avg_start": b.load_start,
        "load_avg_end": os.getloadavg()[0],
        "quick": bool(args.quick),
        "seconds": med,
        "cpu_seconds": cpu,
        "async_blocked_s": median(blocked),
        "async_first_blocked_s": blocked[0],
        "effective_stall_s": median(stalls),
        "async_extra_cpu_s": median(extra_cpu),
        "baseline_step_s": base,
        "step_during_save_s": median(during),
    }
    lines += [
        "",
        "targets:",
        "  async blocked / sync dcp.save <= 0.03: median "
        f"{summary['async_blocked_over_sync_dcp']:.3f}, first "
        f"{summary['async_first_blocked_over_sync_dcp']:.3f}",
        f"  effective stall / our sync save <= 0.25: {summary['effective_stall_over_sync']:.3f}"
        f" (over sync dcp.save {summary['effective_stall_over_sync_dcp']:.3f})",
        f"  our sync throughput / dd2 >= 0.9: {summary['sync_throughput_over_dd']:.3f}"
        f" (over dd1 {summary['sync_throughput_over_dd1']:.3f}); plain dcp.save "
        f"{summary['dcp_over_dd']:.3f}, torch.save {summary['torch_save_over_dd']:.3f}",
    ]
    print("\n".join(lines), flush=True)
    print(json.dumps(_rounded(summary)), flush=True)
    return summary


def _rounded(o: Any) -> Any:
    if isinstance(o, float):
        return round(o, 4)
    if isinstance(o, dict):
        return {k: _rounded(v) for k, v in o.items()}
    return o


def worker(args: argparse.Namespace, *, cleanup: bool) -> None:
    b = Bench(args)
    try:
        res = b.run()
        b.mgr.close()
        if hasattr(b, "mgr2"):
            b.mgr2.close()
        if b.rank == 0:
            report(b, res)
            if args.raw:
                Path(args.raw).write_text(json.dumps(res, indent=1))
    finally:
        from resilient.runtime.dist import shutdown_distributed

        shutdown_distributed(b.ctx)
        if cleanup and b.rank == 0:
            shutil.rmtree(args.workdir, ignore_errors=True)


def main() -> int:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        return launch(args)
    own = args.workdir is None
    if own:  # started by hand under torchrun: every rank derives the same directory
        parent = Path(args.dir) if args.dir else REPO / "bench-output"
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        args.workdir = str(parent / f"bench_ckpt_{run_id}_{os.environ.get('MASTER_PORT', '0')}")
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    worker(args, cleanup=own and not args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
