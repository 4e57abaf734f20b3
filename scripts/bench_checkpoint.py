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
- write2: the disk's own rate, the baseline of every save ratio: each rank writes its half
  of the bytes (random, from memory) in 8 MiB write() calls and fsyncs, as DCP's writer
  does, with nothing else; run at the start and at the end of every repetition;
- dd1 / dd2: `dd if=/dev/zero bs=8M conv=fdatasync` of the same byte count, from rank 0
  alone (dd1) or half from each rank at once (dd2), for reference;
- after each sync save, its loads, each from a dropped page cache: read2 (each rank reads the
  files it loads into memory, nothing else: the baseline of load ratios), load (ours,
  verified in one pass), load2 (ours with verify_buffer_mib=0: check, then read again),
  dcp_load (plain dcp.load, no verification);
- reshard: the same state saved by one rank (a plain copy of the model on rank 0) and loaded
  2 -> 1, 1 -> 2, 1 -> 1 and 2 -> 2, each load checked bitwise (state_digest);
- steps: training steps with no save, the baseline step time.

Before every timed variant the page cache is written back and dropped (`sync; echo 3 >
/proc/sys/vm/drop_caches`, root only; the run says whether it could), so each variant starts
from the same state of the disk, and loads read from the disk. Ratios are paired: each
repetition's ratio against the baselines of the same repetition, then the median over
repetitions.

`--scale` instead saves and loads 64 MiB, 256 MiB, 1 GiB and 4 GiB of state (`--sizes`):
seconds, GB/s and the ratio to write2 at each size, and the resharded loads up to
`--reshard-max-mib`; `--plot FILE.png` draws the curves.

Prints a table of medians and ratios; the last line of stdout is one JSON object with the
ratios, so runs can be compared. Timings are noisy on a shared machine: compare ratios
taken in the same run, never absolute figures across runs.
"""

from __future__ import annotations

import argparse
import gc
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
    p.add_argument(
        "--scale", action="store_true", help="save/load curves over --sizes instead of the table"
    )
    p.add_argument("--sizes", default="64,256,1024,4096", help="--scale: state sizes in MiB")
    p.add_argument(
        "--reshard-max-mib",
        type=int,
        default=1024,
        help="largest state whose resharded loads are measured (rank 0 holds a full copy)",
    )
    p.add_argument("--plot", default=None, help="--scale: write the curves to this PNG")
    p.add_argument("--raw", default=None, help="write every measurement to this JSON file")
    p.add_argument("--keep", action="store_true", help="keep the working directory")
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)  # set by the launcher
    args = p.parse_args(argv)
    args.reps = args.reps or (3 if args.quick or args.scale else 5)
    args.size_list = [int(x) for x in args.sizes.split(",") if x]
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

        from resilient import log
        from resilient.runtime.dist import init_distributed

        self.args = args
        self.load_start = os.getloadavg()[0]  # other work on the machine skews every figure
        self.torch, self.dist = torch, dist
        self.work = Path(args.workdir)
        self.ctx = init_distributed(timeout_s=600, side_timeout_s=600)
        self.rank, self.world = self.ctx.rank, self.ctx.world_size
        self.ctrl = self.ctx.control_group
        # rank 0 alone: saves and loads of the one-rank checkpoint (resharding)
        self.solo = dist.new_group([0], backend="gloo")
        # The manager's events (with its write/commit split) go to <work>/logs/rank<R>.jsonl.
        self.log_path = log.configure(
            run_dir=self.work, run_id="bench", rank=self.rank, restart=0, console_level="ERROR"
        )
        self.drop_caches = self._can_drop_caches()
        self.block = os.urandom(8 * MIB)  # what write2 writes, over and over
        self.mgrs: list[Any] = []

    def build(self, width: int, layers: int) -> None:
        """A fresh FSDP2 model of `layers` x Linear(width, width), AdamW state, managers."""
        import torch
        from torch import nn
        from torch.distributed.fsdp import fully_shard

        from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState

        self.close_managers()
        self.width, self.layers = width, layers
        torch.manual_seed(0)
        mods: list[nn.Module] = []
        for _ in range(layers):
            mods += [nn.Linear(width, width), nn.ReLU()]
        self.model = nn.Sequential(*mods)
        for m in self.model:
            if isinstance(m, nn.Linear):
                fully_shard(m)
        fully_shard(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        g = torch.Generator().manual_seed(1 + self.rank)
        self.x = torch.randn(self.args.batch, width, generator=g)

        self.state = TrainState(model=self.model, optimizer=self.opt)
        self.ours_root = self.work / "ours"

        def mgr(root: Path, group: Any, **kw: Any) -> Any:
            m = CheckpointManager(
                CheckpointConfig(
                    url=str(root), keep_last=1, write_threads=self.args.write_threads, **kw
                ),
                process_group=group,
            )
            self.mgrs.append(m)
            return m

        group = self.ctx.checkpoint_group
        self.mgr = mgr(self.ours_root, group, async_save=True)
        self.mgr_2pass = mgr(self.ours_root, group, verify_buffer_mib=0)
        self.mgr_from1 = mgr(self.work / "solo", group)  # 1 -> 2
        self.mgr_solo = None  # rank 0 only, over self.solo: 2 -> 1, 1 -> 1, the 1-rank save
        if self.rank == 0:
            self.mgr_solo = mgr(self.work / "solo", self.solo)
            self.mgr_solo_from2 = mgr(self.ours_root, self.solo)
        # The runtime's fence (Runtime._install_fences): an optimizer step pre-hook calling
        # wait_staged(). Timed here, because the time it blocks is time the loop is blocked.
        self.fence_s = 0.0

        def fence(*_: Any) -> None:
            t0 = time.perf_counter()
            self.mgr.wait_staged()
            self.fence_s += time.perf_counter() - t0

        self.opt.register_step_pre_hook(fence)
        self.step = 0
        for _ in range(1 if self.args.scale else 3):  # optimizer state exists from here on
            self.train_step()
        self.payload = self.state_bytes()

    def close_managers(self) -> None:
        for m in self.mgrs:
            m.close()
        self.mgrs = []
        for name in ("model", "opt", "state", "plain", "plain_opt"):
            self.__dict__.pop(name, None)
        gc.collect()

    def _can_drop_caches(self) -> bool:
        ok = False
        if self.rank == 0:
            try:
                os.sync()
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
                ok = True
            except OSError:
                ok = False
        t = self.torch.tensor([int(ok)])
        self.dist.broadcast(t, src=0, group=self.ctrl)
        return bool(t.item())

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

    def settle(self) -> None:
        """Write back and drop the page cache (where allowed), so the next variant starts
        from the same state: no dirty pages of the previous one, loads read from the disk."""
        self.barrier()
        if self.rank == 0:
            os.sync()
            if self.drop_caches:
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
        self.barrier()

    def clear(self, path: Path) -> None:
        """Delete a variant's output (rank 0), then settle the disk before the next one."""
        self.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        self.settle()

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
        self.settle()
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
        """Our sync save, then its loads from a dropped page cache, in a rotated order."""
        step = self.step
        r = self.timed(lambda: self.mgr.save(self.state, step, blocking=True))
        size = dir_bytes(self.ours_root) if self.rank == 0 else 0
        self.check(self.mgr, step)
        loads: dict[str, dict[str, float]] = {}
        names = ["read2", "load", "load2", "dcp_load"]
        k = len(self.done_sync) % len(names)
        for name in names[k:] + names[:k]:
            loads[name] = self.timed(lambda name=name: self._load_variant(name, step))
        self.done_sync.append(step)
        self.clear(self.ours_root)
        return {**r, "bytes": size, "events": self.last_commit(), "loads": loads}

    def _load_variant(self, name: str, step: int) -> None:
        from resilient.checkpoint.manifest import step_dir

        d = self.ours_root / step_dir(step)
        if name == "read2":  # the files this rank's load reads, into memory, nothing else
            for f in d.glob(f"__{self.rank}_*.distcp"):
                with open(f, "rb", buffering=0) as fh:
                    buf = bytearray(f.stat().st_size)
                    fh.readinto(buf)
        elif name == "load":
            assert self.mgr.load_latest(self.state) == step
        elif name == "load2":
            assert self.mgr_2pass.load_latest(self.state) == step
        elif name == "dcp_load":
            import torch.distributed.checkpoint as dcp

            sd = self.state.load_template(rank=self.rank, has_rank_blob=True)
            dcp.load(sd, checkpoint_id=str(d), process_group=self.ctx.checkpoint_group)

    def v_write2(self) -> dict[str, Any]:
        """Each rank writes its half of the payload (random bytes) in 8 MiB writes, fsyncs."""
        out = self.work / "write2"
        out.mkdir(parents=True, exist_ok=True)
        share = self.payload // self.world + (self.payload % self.world if self.rank == 0 else 0)
        block = memoryview(self.block)

        def run() -> None:
            with open(out / f"w{self.rank}.bin", "wb", buffering=0) as f:
                left = share
                while left > 0:
                    left -= f.write(block[: min(left, len(block))])
                os.fsync(f.fileno())

        r = self.timed(run)
        self.clear(out)
        return {**r, "bytes": self.payload}

    def v_reshard(self) -> dict[str, Any]:
        """Save on 2 ranks and on 1 (a plain copy on rank 0); load 2->1, 1->1, 1->2, 2->2;
        every load checked bitwise against the state that was saved."""
        from torch import nn

        from resilient.checkpoint import TrainState, state_digest

        step = self.step
        want = state_digest(self.model, self.opt)  # a collective over both ranks
        self.mgr.save(self.state, step, blocking=True)
        if self.rank == 0 and not hasattr(self, "plain"):
            self.torch.manual_seed(1)
            mods: list[nn.Module] = []
            for _ in range(self.layers):
                mods += [nn.Linear(self.width, self.width), nn.ReLU()]
            self.plain = nn.Sequential(*mods)
            self.plain_opt = self.torch.optim.AdamW(self.plain.parameters(), lr=1e-5)
        plain = TrainState(model=self.plain, optimizer=self.plain_opt) if self.rank == 0 else None
        if self.rank == 0 and not self.plain_opt.state:  # warm: AdamW state, first-load costs
            self.mgr_solo_from2.load_latest(plain)
        out: dict[str, Any] = {}

        def solo(fn: Callable[[], Any]) -> Callable[[], None]:
            return lambda: fn() if self.rank == 0 else None

        assert self.mgr_solo is not None or self.rank != 0
        out["2to1"] = self.timed(solo(lambda: self.mgr_solo_from2.load_latest(plain)))
        ok = [self.rank != 0 or state_digest(self.plain, self.plain_opt) == want]
        self.barrier()
        self.timed(solo(lambda: self.mgr_solo.save(plain, step, blocking=True)))
        out["1to1"] = self.timed(solo(lambda: self.mgr_solo.load_latest(plain)))
        ok.append(self.rank != 0 or state_digest(self.plain, self.plain_opt) == want)
        out["1to2"] = self.timed(lambda: self.mgr_from1.load_latest(self.state))
        ok.append(state_digest(self.model, self.opt) == want)
        out["2to2"] = self.timed(lambda: self.mgr.load_latest(self.state))
        ok.append(state_digest(self.model, self.opt) == want)
        everyone: list[Any] = [None] * self.world
        self.dist.all_gather_object(everyone, ok, group=self.ctrl)
        if not all(all(x) for x in everyone):
            raise RuntimeError(f"a resharded load is not bitwise exact: {everyone}")
        self.clear(self.ours_root)
        self.clear(self.work / "solo")
        return {k: v["seconds"] for k, v in out.items()}

    def v_async(self) -> dict[str, Any]:
        """save() then train until every rank's save has committed.

        blocked: time in save() plus time in the fence. effective stall: wall time from
        save() to the end of the first step after which no rank has a save in flight,
        minus that many baseline steps (computed later, once the baseline is known).
        """
        self.settle()
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
        from resilient.checkpoint._dcp_write import _LocalWriter

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
    def run(self, variants: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
        # async first in repetition 0: its first save is the run's first save, cold.
        if variants is None:
            variants = ["async", "sync", "dcp", "torch_save", "dd1", "dd2", "steps", "reshard"]
            if self.args.breakdown:
                variants += BREAKDOWN
        self.done_sync: list[int] = []
        results: dict[str, list[dict[str, Any]]] = {v: [] for v in [*variants, "write2"]}
        for rep in range(self.args.reps):
            order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
            base = [self.v_write2()]  # the disk's rate at the start and end of the repetition
            for name in order:
                r = getattr(self, f"v_{name}")()
                results[name].append(r)
            base.append(self.v_write2())
            results["write2"].append(
                {
                    "seconds": statistics.mean(b["seconds"] for b in base),
                    "cpu": statistics.mean(b["cpu"] for b in base),
                    "each": [b["seconds"] for b in base],
                }
            )
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


def paired(res: dict[str, list[dict[str, Any]]], v: str, base: str = "write2") -> float:
    """Median over repetitions of base time / v time, both from the same repetition."""
    return median([b["seconds"] / r["seconds"] for b, r in zip(res[base], res[v], strict=True)])


def load_figures(res: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Seconds of each load variant (median) and its ratio to read2, paired per repetition."""
    loads = [r["loads"] for r in res["sync"]]
    out: dict[str, Any] = {"seconds": {}, "vs_read2": {}}
    for k in ("read2", "load", "load2", "dcp_load"):
        out["seconds"][k] = median([x[k]["seconds"] for x in loads])
        out["vs_read2"][k] = median([x["read2"]["seconds"] / x[k]["seconds"] for x in loads])
    out["cpu"] = {k: median([x[k]["cpu"] for x in loads]) for k in ("load", "load2", "dcp_load")}
    return out


def reshard_figures(res: dict[str, list[dict[str, Any]]]) -> dict[str, float] | None:
    if not res.get("reshard"):
        return None
    rs = res["reshard"]
    return {
        "2to1": median([r["2to1"] / r["1to1"] for r in rs]),
        "1to2": median([r["1to2"] / r["2to2"] for r in rs]),
        **{f"{k}_s": median([r[k] for r in rs]) for k in ("2to1", "1to1", "1to2", "2to2")},
    }


def header(b: Bench) -> str:
    import torch

    return (
        f"torch {torch.__version__}, {os.cpu_count()} CPUs; load average at start "
        f"{b.load_start:.2f}, now {os.getloadavg()[0]:.2f} (1 min); page cache dropped before "
        f"each variant: {'yes' if b.drop_caches else 'NO (not root): loads read from the cache'}"
    )


def report(b: Bench, res: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians, ratios, a table on stdout; returns the JSON summary."""
    args = b.args
    payload = b.payload
    gb = payload / 1e9
    base_steps = [t for r in res["steps"] for t in r["step_times"]]
    base = median(base_steps)
    base_cpu = median([r["cpu_per_step"] for r in res["steps"]])
    timed = ["write2", "dd1", "dd2", "torch_save", "dcp", "sync"]
    timed += BREAKDOWN if args.breakdown else []
    med = {k: median([r["seconds"] for r in res[k]]) for k in timed}
    cpu = {k: median([r["cpu"] for r in res[k]]) for k in timed}
    asy = res["async"]
    blocked = [r["blocked"] for r in asy]
    stalls = [r["window"] - len(r["step_times"]) * base for r in asy]
    extra_cpu = [r["cpu"] - len(r["step_times"]) * base_cpu for r in asy]
    during = [t for r in asy for t in r["step_times"]]
    lf = load_figures(res)
    rf = reshard_figures(res)

    lines = [
        f"state: FSDP2 {args.layers} x Linear({args.width}, {args.width}) + AdamW on "
        f"{b.world} ranks, {payload / MIB:.1f} MiB ({payload} bytes); {args.reps} repetitions; "
        + header(b),
        "seconds: median (min..max), wall time barrier to barrier; CPU: median CPU seconds, "
        "both ranks; x disk = write2 time / variant time and x dd2 the same for dd2, each the "
        "median over repetitions of the ratio within the repetition",
        f"{'variant':<34}{'seconds':>24}{'GB/s':>7}{'CPU s':>7}{'x disk':>7}{'x dd2':>7}",
    ]
    labels = {
        "write2": "write2: 2 ranks write()+fsync",
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
            f"{labels[k]:<34}{rng:>24}{gb / med[k]:>7.2f}{cpu[k]:>7.2f}"
            f"{paired(res, k):>7.2f}{paired(res, k, 'dd2'):>7.2f}"
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
    lines += ["", "loads of the sync save (page cache dropped), x read2 = read2 time / load time:"]
    load_labels = {
        "read2": "read2: each rank reads its files",
        "load": "ours, verified in one pass",
        "load2": "ours, check then read (2 passes)",
        "dcp_load": "plain dcp.load, no verification",
    }
    for k, label in load_labels.items():
        c = lf["cpu"].get(k)
        lines.append(
            f"{label:<34}{lf['seconds'][k]:>10.3f} s{gb / lf['seconds'][k]:>7.2f} GB/s"
            f"{'' if c is None else f'{c:>7.2f} CPU s'}  x read2 {lf['vs_read2'][k]:.2f}"
        )
    if rf:
        lines.append(
            f"resharded loads (bitwise checked): 2->1 {rf['2to1_s']:.3f} s vs 1->1 "
            f"{rf['1to1_s']:.3f} s = {rf['2to1']:.2f}; 1->2 {rf['1to2_s']:.3f} s vs 2->2 "
            f"{rf['2to2_s']:.3f} s = {rf['1to2']:.2f} (medians of per-repetition ratios)"
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
        "sync_throughput_over_disk": paired(res, "sync"),
        "sync_throughput_over_dd": paired(res, "sync", "dd2"),
        "dcp_over_disk": paired(res, "dcp"),
        "torch_save_over_disk": paired(res, "torch_save"),
        "dd2_over_disk": paired(res, "dd2"),
        "disk_baseline": "write2",
        "cpu_s_per_gb": cpu["sync"] / gb,
        "cpu_s_per_gb_dcp": cpu["dcp"] / gb,
        "async_extra_cpu_s_per_gb": median(extra_cpu) / gb,
        "load_vs_get": lf["vs_read2"]["load"],
        "load2_vs_get": lf["vs_read2"]["load2"],
        "dcp_load_vs_get": lf["vs_read2"]["dcp_load"],
        "load_cpu_s_per_gb": lf["cpu"]["load"] / gb,
        "load2_cpu_s_per_gb": lf["cpu"]["load2"] / gb,
        "reshard_over_same": None if rf is None else {k: rf[k] for k in ("2to1", "1to2")},
        "scale": [],
        "bytes": payload,
        "reps": args.reps,
        "load_avg_start": b.load_start,
        "load_avg_end": os.getloadavg()[0],
        "page_cache_dropped": b.drop_caches,
        "quick": bool(args.quick),
        "seconds": med,
        "cpu_seconds": cpu,
        "load_seconds": lf["seconds"],
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
        f"  effective stall / our sync save <= 0.5 (stretch 0.25): "
        f"{summary['effective_stall_over_sync']:.3f}"
        f" (over sync dcp.save {summary['effective_stall_over_sync_dcp']:.3f})",
        f"  our sync throughput / disk (write2) >= 0.9: {summary['sync_throughput_over_disk']:.3f}"
        f" (over dd2 {summary['sync_throughput_over_dd']:.3f}); plain dcp.save "
        f"{summary['dcp_over_disk']:.3f}, torch.save {summary['torch_save_over_disk']:.3f}",
        f"  CPU s per GB saved: ours {summary['cpu_s_per_gb']:.2f} (plain dcp.save "
        f"{summary['cpu_s_per_gb_dcp']:.2f}); async, extra over the steps: "
        f"{summary['async_extra_cpu_s_per_gb']:.2f}",
        f"  load / read2: {summary['load_vs_get']:.3f} (two passes {summary['load2_vs_get']:.3f}"
        f", plain dcp.load {summary['dcp_load_vs_get']:.3f})",
    ]
    if rf:
        lines.append(
            f"  resharded / same-topology load <= 1.5: 2->1 {rf['2to1']:.2f}, 1->2 {rf['1to2']:.2f}"
        )
    print("\n".join(lines), flush=True)
    print(json.dumps(_rounded(summary)), flush=True)
    return summary


SCALE_VARIANTS = ["sync", "dcp", "dd2"]


def scale_shape(mib: int) -> tuple[int, int]:
    """(width, layers) of a Linear stack whose params + AdamW moments are about `mib` MiB."""
    width = 1024 if mib < 1024 else 2048
    per_layer = 3 * 4 * width * (width + 1)
    return width, max(1, round(mib * MIB / per_layer))


def scale(b: Bench) -> dict[str, Any]:
    """Save and load curves over --sizes; returns the JSON summary with its `scale` list."""
    args = b.args
    entries = []
    for mib in args.size_list:
        width, layers = scale_shape(mib)
        args.width, args.layers = width, layers
        b.build(width, layers)
        variants = list(SCALE_VARIANTS)
        if mib <= args.reshard_max_mib:
            variants.append("reshard")
        res = b.run(variants)
        gb = b.payload / 1e9
        lf = load_figures(res)
        rf = reshard_figures(res)
        e = {
            "mib": round(b.payload / MIB, 1),
            "bytes": b.payload,
            "shape": f"{layers} x Linear({width}, {width})",
            "save_s": median([r["seconds"] for r in res["sync"]]),
            "dcp_s": median([r["seconds"] for r in res["dcp"]]),
            "disk_s": median([r["seconds"] for r in res["write2"]]),
            "dd2_s": median([r["seconds"] for r in res["dd2"]]),
            "load_s": lf["seconds"]["load"],
            "read_s": lf["seconds"]["read2"],
            "save_over_disk": paired(res, "sync"),
            "dcp_over_disk": paired(res, "dcp"),
            "load_over_read": lf["vs_read2"]["load"],
            "cpu_s_per_gb": median([r["cpu"] for r in res["sync"]]) / gb,
            "reshard_over_same": None if rf is None else {k: rf[k] for k in ("2to1", "1to2")},
            "load_avg": os.getloadavg()[0],
        }
        e["save_gbps"] = gb / e["save_s"]
        e["disk_gbps"] = gb / e["disk_s"]
        e["load_gbps"] = gb / e["load_s"]
        e["read_gbps"] = gb / e["read_s"]
        entries.append(e)
        if b.rank == 0:
            print(f"# {mib} MiB done: {json.dumps(_rounded(e))}", file=sys.stderr, flush=True)
    lines = [
        f"scale: FSDP2 Linear stacks + AdamW on {b.world} ranks, {args.reps} repetitions per "
        "size; " + header(b),
        "save = our sync save, disk = write2 (2 ranks write()+fsync), load = ours (verified, one"
        " pass), read = read2; ratios are medians of per-repetition ratios",
        f"{'MiB':>7}{'save s':>8}{'GB/s':>6}{'disk GB/s':>10}{'save/disk':>10}{'load s':>8}"
        f"{'GB/s':>6}{'read GB/s':>10}{'load/read':>10}{'CPU s/GB':>9}{'2->1':>6}{'1->2':>6}",
    ]
    for e in entries:
        rs = e["reshard_over_same"] or {}
        lines.append(
            f"{e['mib']:>7.0f}{e['save_s']:>8.2f}{e['save_gbps']:>6.2f}{e['disk_gbps']:>10.2f}"
            f"{e['save_over_disk']:>10.2f}{e['load_s']:>8.2f}{e['load_gbps']:>6.2f}"
            f"{e['read_gbps']:>10.2f}{e['load_over_read']:>10.2f}{e['cpu_s_per_gb']:>9.2f}"
            + "".join(f"{rs[k]:>6.2f}" if k in rs else f"{'-':>6}" for k in ("2to1", "1to2"))
        )
    summary = {
        "bench": "checkpoint_scale",
        "reps": args.reps,
        "load_avg_start": b.load_start,
        "load_avg_end": os.getloadavg()[0],
        "page_cache_dropped": b.drop_caches,
        "cpu_s_per_gb": median([e["cpu_s_per_gb"] for e in entries]),
        "load_vs_get": median([e["load_over_read"] for e in entries]),
        "reshard_over_same": [e["reshard_over_same"] for e in entries if e["reshard_over_same"]],
        "scale": entries,
    }
    if b.rank == 0:
        print("\n".join(lines), flush=True)
        if args.plot:
            plot(entries, args.plot, header(b))
        print(json.dumps(_rounded(summary)), flush=True)
    return summary


def plot(entries: list[dict[str, Any]], path: str, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [e["mib"] for e in entries]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=80)
    for key, label, style in (
        ("save_s", "our sync save", "o-"),
        ("disk_s", "disk: write()+fsync, 2 ranks", "s--"),
        ("load_s", "our load (verified, 1 pass)", "^-"),
        ("read_s", "read of the same files", "v--"),
    ):
        left.plot(x, [e[key] for e in entries], style, label=label)
    left.set(xscale="log", yscale="log", xlabel="state (MiB)", ylabel="seconds")
    left.set_title("time against state size")
    left.legend(fontsize=8)
    for key, label, style in (
        ("save_over_disk", "save / disk", "o-"),
        ("load_over_read", "load / read", "^-"),
    ):
        right.plot(x, [e[key] for e in entries], style, label=label)
    right.axhline(0.9, color="grey", lw=0.8, ls=":")
    right.set(xscale="log", xlabel="state (MiB)", ylabel="rate ratio (1 = the disk's pace)")
    right.set_ylim(0, max(1.2, *(e["save_over_disk"] for e in entries)) * 1.05)
    right.set_title("ratio to the baseline, per repetition")
    right.legend(fontsize=8)
    fig.suptitle("checkpoint save/load, FSDP2 + AdamW, 2 ranks", fontsize=10)
    fig.text(0.01, 0.01, note, fontsize=6)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path)


def _rounded(o: Any) -> Any:
    if isinstance(o, float):
        return round(o, 4)
    if isinstance(o, dict):
        return {k: _rounded(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_rounded(v) for v in o]
    return o


def worker(args: argparse.Namespace, *, cleanup: bool) -> None:
    b = Bench(args)
    try:
        if args.scale:
            scale(b)
            b.close_managers()
            return
        b.build(args.width, args.layers)
        res = b.run()
        b.close_managers()
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
