"""The checkpoint benchmark's measured variants (bench_checkpoint.py): one training state
written and read back the ways the benchmark compares, each timed on every rank."""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
BREAKDOWN = ["dcp_nofsync", "dcp_nozipcrc", "writer", "writer_nozipcrc", "sync_wt2"]
"""The variants `--breakdown` adds: where a save's CPU time goes."""


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_baseline(path: Path, nbytes: int, block: bytes, *, drop_behind: bool = False) -> None:
    """`nbytes` to `path` in `block`-sized write() calls, then fsync: the disk's own rate
    (write2). With `drop_behind`, the page cache is told to drop the pages behind the writes
    every 64 MiB, as our writer does (resilient/checkpoint/_dcp_write.py, not imported: a
    baseline must not run the code it measures)."""
    view = memoryview(block)
    with open(path, "wb", buffering=0) as f:
        left, previous, newest = nbytes, 0, 0
        while left > 0:
            left -= f.write(view[: min(left, len(view))])
            at = nbytes - left
            if drop_behind and at - newest >= 64 * MIB:
                os.posix_fadvise(f.fileno(), previous, at - previous, os.POSIX_FADV_DONTNEED)
                previous, newest = newest, at
        os.fsync(f.fileno())


class Bench:
    """Everything one rank needs: groups, model, optimizer, the manager under test."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        from resilient import log
        from resilient.groups.groups import init_distributed

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
        self.read_buf = bytearray(8 * MIB)  # what read2 reads into, over and over
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
        # The manager's own fence (checkpoint/pipeline.py): an optimizer step pre-hook calling
        # wait_staged(). Timed here, registered before the manager's (which then finds the
        # copy done): the time it blocks is time the loop is blocked.
        self.fence_s = 0.0

        # --live: a prototype measured beside the product (v_async_live), not in it
        self.live: Any = None
        self.mgr_live = mgr(self.work / "live", group) if self.args.live else None

        def fence(*_: Any) -> None:
            t0 = time.perf_counter()
            self.mgr.wait_staged()
            if self.live is not None:  # the prototype's fence holds until the write is done
                self.live.result()
                self.live = None
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
        names = [] if self.args.stall else ["read2", "load", "load2", "dcp_load"]
        k = len(self.done_sync) % max(1, len(names))
        for name in names[k:] + names[:k]:
            loads[name] = self.timed(lambda name=name: self._load_variant(name, step))
        self.done_sync.append(step)
        self.clear(self.ours_root)
        return {**r, "bytes": size, "events": self.last_commit(), "loads": loads}

    def _load_variant(self, name: str, step: int) -> None:
        from resilient.checkpoint.manifest import step_dir

        d = self.ours_root / step_dir(step)
        if name == "read2":  # the files this rank's load reads, and nothing else
            # the disk's pace, not our memory's: 8 MiB reads into one reused buffer (as
            # write2 writes), the kernel told the reads are sequential (a larger read-ahead);
            # one file-sized buffer cost its zero-fill and page faults on top of the disk
            buf = memoryview(self.read_buf)
            for f in d.glob(f"__{self.rank}_*.distcp"):
                with open(f, "rb", buffering=0) as fh:
                    os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    while fh.readinto(buf):
                        pass
        elif name == "load":
            assert self.mgr.load_latest(self.state) == step
        elif name == "load2":
            assert self.mgr_2pass.load_latest(self.state) == step
        elif name == "dcp_load":
            import torch.distributed.checkpoint as dcp

            sd = self.state.load_template(rank=self.rank, has_rank_blob=True)
            dcp.load(sd, checkpoint_id=str(d), process_group=self.ctx.checkpoint_group)

    def v_write2(self, *, drop_behind: bool = False) -> dict[str, Any]:
        """Each rank writes its half of the payload (random bytes) with `write_baseline`."""
        out = self.work / "write2"
        out.mkdir(parents=True, exist_ok=True)
        share = self.payload // self.world + (self.payload % self.world if self.rank == 0 else 0)
        path = out / f"w{self.rank}.bin"
        r = self.timed(lambda: write_baseline(path, share, self.block, drop_behind=drop_behind))
        self.clear(out)
        return {**r, "bytes": self.payload}

    def v_write2_drop(self) -> dict[str, Any]:
        return self.v_write2(drop_behind=True)

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

    def _train_through_save(
        self, start: Callable[[int, float], None], in_flight: Callable[[], bool]
    ) -> tuple[dict[str, Any], int]:
        """Start a save of the current step, then train until no rank has it in flight.

        blocked: time in `start` plus time in the fence. effective stall: wall time from
        `start` to the end of the first step after which no rank has a save in flight,
        minus that many baseline steps (computed later, once the baseline is known)."""
        self.settle()
        self.fence_s = 0.0
        step = self.step
        c0 = self.cpu_now()
        t0 = time.perf_counter()
        start(step, t0)
        in_save = time.perf_counter() - t0
        step_times = []
        while True:
            ts = time.perf_counter()
            self.train_step()
            busy = self.any_rank(in_flight())
            step_times.append(time.perf_counter() - ts)
            if not busy:
                break
        window = time.perf_counter() - t0
        cpu = self.sum_ranks(self.cpu_now() - c0)
        return {
            "in_save": in_save,
            "fence": self.fence_s,
            "window": window,
            "cpu": cpu,
            "step_times": step_times,
        }, step

    def _slowest(self, r: dict[str, Any]) -> dict[str, Any]:
        """The blocked time and its parts of the rank that was blocked longest."""
        blocked = r["in_save"] + r["fence"]
        t = self.torch.tensor([blocked, r["in_save"], r["fence"]], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.ctrl)
        return {**r, "blocked": float(t[0]), "in_save": float(t[1]), "fence": float(t[2])}

    def v_async(self) -> dict[str, Any]:
        """The product's async save: save(), then train until every rank's save committed."""
        r, step = self._train_through_save(
            lambda step, _t0: self.mgr.save(self.state, step), lambda: self.mgr.in_flight
        )
        self.mgr.wait()  # raises if the save failed
        r = self._slowest(r)
        size = dir_bytes(self.ours_root) if self.rank == 0 else 0
        self.check(self.mgr, step)
        self.clear(self.ours_root)
        return {**r, "bytes": size, "events": self.last_commit()}

    def v_async_live(self) -> dict[str, Any]:
        """Prototype for issue 12's effective stall, not the product: no staging copy. The
        save writes straight from the live tensors on a thread of its own, and the fence
        (the optimizer's pre-step hook) holds the loop until the write is done, so nothing
        changes a tensor under it. Timed as v_async."""
        from concurrent.futures import ThreadPoolExecutor

        mgr = self.mgr_live
        assert mgr is not None
        pool = ThreadPoolExecutor(max_workers=1)

        def start(step: int, t0: float) -> None:
            sd = self.state.to_state_dict(step=step, rank=self.rank)
            self.live = pool.submit(
                mgr._write_and_commit, sd, step, t0, staged_at=t0, on_loop=False
            )

        r, step = self._train_through_save(
            start, lambda: self.live is not None and not self.live.done()
        )
        if self.live is not None:
            self.live.result()  # raises if the save failed
            self.live = None
        pool.shutdown()
        r = self._slowest(r)
        self.check(mgr, step)
        self.clear(self.work / "live")
        return r

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
            variants = ["async", "sync", "dcp", "torch_save", "dd1", "dd2", "write2_drop"]
            variants += ["steps", "reshard"]
            if self.args.breakdown:
                variants += BREAKDOWN
            if self.args.live:
                variants.insert(1, "async_live")
            if self.args.stall:  # the effective stall alone: more repetitions in the time
                variants = [v for v in variants if v in ("async", "async_live", "sync", "steps")]
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
