"""S3 checkpoint throughput: our save and load against s3fs put/get of the same files.

    .venv/bin/python scripts/bench_storage.py            # full run, a few minutes
    .venv/bin/python scripts/bench_storage.py --quick    # smaller state, under a minute

Starts moto's S3 server in a child process on a free loopback port (its own interpreter, so
server and client do not share a GIL) and points AWS_* variables of this process at it with
fake credentials; nothing leaves the machine. The state is a plain nn.Linear stack with its
AdamW state (one process, one data file per writer thread).

For each transfer configuration (writer threads, parts in flight per file, part size), in
every repetition, in a rotated order:

- save: CheckpointManager.save(blocking=True) to a fresh step: DCP serialisation, the upload,
  the commit (size check, manifest PUT) and retention;
- put: s3fs put of the very files that save wrote (fetched once to a local directory), with
  the same part size and parts in flight;
- load: load_latest into the live state: manifest, then DCP's read, every file checked
  against the manifest from the bytes DCP reads (one read of each byte);
- load2: the same with CheckpointConfig(verify_buffer_mib=0): a streaming check first, then
  DCP reads again (two reads of each byte, what every load did before single-pass loads);
- get: s3fs get of the same files to a local directory.

CPU seconds of the process (all threads, moto excluded: it is a child process) are taken
around each save and load; `cpu_s_per_gb` is the save's.

The server (moto, pure Python) is the bottleneck, so only ratios taken in the same run mean
anything: save/put is the target (>= 0.8). Prints a table of medians; the last line of stdout
is one JSON object with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MIB = 1 << 20

_SERVER = """
import logging, sys, time
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # until the parent closes our stdin (or dies)
server.stop()
"""


@dataclass(frozen=True)
class Transfer:
    threads: int  # CheckpointConfig.write_threads: data files written at once
    concurrency: int | None  # parts in flight per file (s3fs max_concurrency); None: default
    part_mib: int | None  # part size (default_block_size, put's chunksize); None: default

    @property
    def name(self) -> str:
        if self.concurrency is None and self.part_mib is None:
            return f"t{self.threads}-default"
        return f"t{self.threads}-c{self.concurrency}-p{self.part_mib}"

    def options(self) -> dict[str, int]:
        """storage_options / S3FileSystem arguments; empty means each side's defaults."""
        opts = {}
        if self.concurrency is not None:
            opts["max_concurrency"] = self.concurrency
        if self.part_mib is not None:
            opts["default_block_size"] = self.part_mib * MIB
        return opts

    def put_kwargs(self) -> dict[str, int]:
        kw = {}
        if self.concurrency is not None:
            kw["max_concurrency"] = self.concurrency
        if self.part_mib is not None:
            kw["chunksize"] = self.part_mib * MIB
        return kw


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller state and sweep, under a minute")
    p.add_argument("--mib", type=int, default=None, help="state size in MiB (default 128/64)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5)")
    p.add_argument("--raw", default=None, help="write every measurement to this JSON file")
    return p.parse_args(argv)


def sweep(quick: bool) -> list[Transfer]:
    """First our default settings on both sides (16 MiB parts, 10 in flight: the same
    requests), then each side's own defaults (s3fs: 50 MiB chunks, a single PUT below 100
    MiB), then a sweep of threads, parts in flight and part size, the same on both sides."""
    if quick:
        return [Transfer(1, 10, 16), Transfer(1, None, None)]
    return [
        Transfer(1, 10, 16),
        Transfer(1, None, None),
        Transfer(1, 1, 16),
        Transfer(1, 4, 16),
        Transfer(1, 10, 8),
        Transfer(1, 10, 32),
        Transfer(2, 10, 16),
    ]


class MotoServer:
    """moto in a child process; stopped by closing its stdin, killed by PID if it lingers."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        port = self.proc.stdout.readline().strip()
        if not port:
            raise RuntimeError("moto server did not start")
        self.endpoint = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def point_env_at(endpoint: str) -> None:
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench-key",
        AWS_SECRET_ACCESS_KEY="bench-secret",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(var, None)


def build_state(mib: int) -> tuple[Any, Any]:
    """A Linear stack whose parameters plus AdamW moments take about `mib` MiB."""
    import torch
    from torch import nn

    from resilient.checkpoint import TrainState

    width = 1024
    layers = max(1, round(mib * MIB / 3 / 4 / (width * width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()  # AdamW's moments exist
    return TrainState(model=model, optimizer=opt), (model, opt)


class Bench:
    def __init__(self, args: argparse.Namespace, endpoint: str) -> None:
        import s3fs

        self.args = args
        self.load_start = os.getloadavg()[0]
        self.bucket = f"bench-{uuid.uuid4().hex[:8]}"
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
        self.fs.mkdir(self.bucket)
        self.state, self.live = build_state(args.mib)
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-storage-"))
        self.step = 0
        self.raw: list[dict[str, Any]] = []
        # One client per configuration, kept across repetitions and warmed up before the first
        # measurement, for both sides: a training run keeps its manager for many saves.
        self.clients: dict[str, tuple[Any, Any]] = {}
        self.two_pass: dict[str, Any] = {}

    def close(self) -> None:
        for mgr, _ in self.clients.values():
            mgr.close()
        for mgr in self.two_pass.values():
            mgr.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _fs(self, t: Transfer) -> Any:
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **t.options())

    def _manager(self, t: Transfer, prefix: str, **kw: Any) -> Any:
        from resilient.checkpoint import CheckpointConfig, CheckpointManager

        return CheckpointManager(
            CheckpointConfig(
                url=f"s3://{self.bucket}/{prefix}",
                async_save=False,
                keep_last=1,
                write_threads=t.threads,
                storage_options=t.options(),
                **kw,
            )
        )

    def _clients(self, t: Transfer) -> tuple[Any, Any]:
        if t.name not in self.clients:
            mgr, fs = self._manager(t, f"ckpt-{t.name}"), self._fs(t)
            two_pass = self._manager(t, f"ckpt-{t.name}", verify_buffer_mib=0)
            mgr.list()
            two_pass.list()
            fs.ls(self.bucket)
            self.clients[t.name] = (mgr, fs)
            self.two_pass[t.name] = two_pass
        return self.clients[t.name]

    def one(self, t: Transfer) -> dict[str, float]:
        """save, get, put, load, load2 of one fresh checkpoint with transfer settings `t`."""
        from resilient.checkpoint.manifest import MANIFEST_NAME, step_dir

        self.step += 1
        prefix = f"ckpt-{t.name}"
        mgr, fs = self._clients(t)
        c0, t0 = cpu_now(), time.perf_counter()
        mgr.save(self.state, self.step)
        save_s = time.perf_counter() - t0
        save_cpu = cpu_now() - c0
        rel = step_dir(self.step)
        src = f"{self.bucket}/{prefix}/{rel}"
        names = [n for n in mgr.storage.list_files(rel) if n != MANIFEST_NAME]
        nbytes = sum(mgr.storage.list_sizes(rel)[n] for n in names)

        local = self.tmp / rel
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True)
        t0 = time.perf_counter()
        for n in names:
            fs.get_file(f"{src}/{n}", str(local / n), **t.put_kwargs())
        get_s = time.perf_counter() - t0

        dst = f"{self.bucket}/put-{t.name}/{rel}"
        t0 = time.perf_counter()
        if t.threads > 1:  # as many files at once as the save wrote
            fs.put(
                [str(local / n) for n in names],
                [f"{dst}/{n}" for n in names],
                batch_size=t.threads,
                **t.put_kwargs(),
            )
        else:
            for n in names:
                fs.put_file(str(local / n), f"{dst}/{n}", **t.put_kwargs())
        put_s = time.perf_counter() - t0
        fs.rm(f"{self.bucket}/put-{t.name}", recursive=True)
        shutil.rmtree(local)

        loads: dict[str, tuple[float, float]] = {}
        order = [("load", mgr), ("load2", self.two_pass[t.name])]
        for name, m in order if self.step % 2 else order[::-1]:  # alternate which goes first
            c0, t0 = cpu_now(), time.perf_counter()
            assert m.load_latest(self.state) == self.step
            loads[name] = (time.perf_counter() - t0, cpu_now() - c0)
        rec = {
            "config": t.name,
            "bytes": nbytes,
            "save": save_s,
            "put": put_s,
            "load": loads["load"][0],
            "load2": loads["load2"][0],
            "get": get_s,
            "save_cpu": save_cpu,
            "load_cpu": loads["load"][1],
            "load2_cpu": loads["load2"][1],
        }
        self.raw.append(rec)
        return rec


def cpu_now() -> float:
    """CPU seconds of this process, all threads (the moto server is a child: not counted)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def median(records: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in records)


def report(bench: Bench, configs: list[Transfer], elapsed: float) -> dict[str, Any]:
    lines = [
        f"# S3 on moto (127.0.0.1), state {bench.args.mib} MiB, {bench.args.reps} repetitions; "
        f"MB/s (1e6 bytes/s) from median times; ratios are medians of back-to-back pairs; "
        f"run took {elapsed:.0f} s; load average {bench.load_start:.2f} at start, "
        f"{os.getloadavg()[0]:.2f} at end",
        f"{'config':<14}{'MB':>7}{'save':>8}{'put':>8}{'save/put':>9}"
        f"{'load':>8}{'load2':>8}{'get':>8}{'load/get':>9}{'load2/get':>10}{'CPU s/GB':>9}",
    ]
    ratios: dict[str, Any] = {}
    for t in configs:
        recs = [r for r in bench.raw if r["config"] == t.name]
        mb = median(recs, "bytes") / 1e6
        rate = {k: mb / median(recs, k) for k in ("save", "put", "load", "load2", "get")}

        def paired(a: str, b: str, recs: list[dict[str, Any]] = recs) -> float:
            """Median over repetitions of b_time / a_time, each pair measured back to back:
            steadier on a shared machine than a ratio of medians."""
            return statistics.median(r[b] / r[a] for r in recs)

        r = {
            "save_vs_put": paired("save", "put"),
            "load_vs_get": paired("load", "get"),
            "load2_vs_get": paired("load2", "get"),
            "cpu_s_per_gb": median(recs, "save_cpu") / (mb / 1e3),
            "load_cpu_s_per_gb": median(recs, "load_cpu") / (mb / 1e3),
            "load2_cpu_s_per_gb": median(recs, "load2_cpu") / (mb / 1e3),
            "save_mbps": rate["save"],
            "put_mbps": rate["put"],
            "load_mbps": rate["load"],
            "get_mbps": rate["get"],
        }
        ratios[t.name] = r
        lines.append(
            f"{t.name:<14}{mb:>7.1f}{rate['save']:>8.1f}{rate['put']:>8.1f}"
            f"{r['save_vs_put']:>9.2f}{rate['load']:>8.1f}{rate['load2']:>8.1f}"
            f"{rate['get']:>8.1f}{r['load_vs_get']:>9.2f}{r['load2_vs_get']:>10.2f}"
            f"{r['cpu_s_per_gb']:>9.2f}"
        )
    lines.append(
        "config t<write threads>-c<parts in flight per file>-p<part MiB>, the same on both "
        "sides (t1-default: each side's own); save/load/load2/put/get in MB/s; load2: two "
        "reads (check, then load); CPU s/GB: the save's, this process"
    )
    print("\n".join(lines), flush=True)
    main = ratios[configs[0].name]
    defaults = ratios[Transfer(1, None, None).name]
    return {
        "bench": "storage_s3_moto",
        "mib": bench.args.mib,
        "reps": bench.args.reps,
        "save_vs_put": main["save_vs_put"],
        "load_vs_get": main["load_vs_get"],
        "load2_vs_get": main["load2_vs_get"],
        "cpu_s_per_gb": main["cpu_s_per_gb"],
        "load_cpu_s_per_gb": main["load_cpu_s_per_gb"],
        "load2_cpu_s_per_gb": main["load2_cpu_s_per_gb"],
        "reshard_over_same": None,  # one process: see bench_checkpoint.py
        "scale": None,  # see bench_checkpoint.py --scale
        "load_avg_start": bench.load_start,
        "load_avg_end": os.getloadavg()[0],
        "save_vs_put_own_defaults": defaults["save_vs_put"],
        "save_vs_put_min": min(r["save_vs_put"] for r in ratios.values()),
        "sweep": {k: {n: round(v, 3) for n, v in r.items()} for k, r in ratios.items()},
    }


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    server = MotoServer()
    try:
        point_env_at(server.endpoint)
        bench = Bench(args, server.endpoint)
        configs = sweep(args.quick)
        bench.one(configs[0])  # warm-up, not counted: first DCP save and load in the process
        bench.raw.clear()
        start = time.perf_counter()
        try:
            for rep in range(args.reps):
                k = rep % len(configs)
                for t in configs[k:] + configs[:k]:  # rotate: no config always goes first
                    bench.one(t)
                progress(f"# repetition {rep + 1}/{args.reps} done")
            summary = report(bench, configs, time.perf_counter() - start)
            if args.raw:
                Path(args.raw).write_text(json.dumps(bench.raw, indent=1))
            return summary
        finally:
            bench.close()
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the moto child and the temporary files are cleaned up.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    args.mib = args.mib or (64 if args.quick else 128)
    args.reps = args.reps or 5
    import logging

    from resilient import log

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    # our events would flood the table; retries still show as warnings
    log.configure(run_dir=None, run_id="bench", rank=0, restart=0, console_level="WARNING")
    summary = run(args, lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(_rounded(summary)), flush=True)


def _rounded(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 3)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return x


if __name__ == "__main__":
    main()
