"""`resilient export` against a plain copy of the same bytes, its peak memory, and S3.

    .venv/bin/python scripts/bench_export.py                  # 1 GiB, 3 repetitions: ~3 min
    .venv/bin/python scripts/bench_export.py --sizes 1,4      # and 4 GiB
    .venv/bin/python scripts/bench_export.py --s3-mib 0       # no S3 part

For each size, a checkpoint is built once: one process, CheckpointManager.save of a model of
`nn.Linear(8192, 8192, bias=False)` layers (256 MiB each, fp32; 4 per GiB), no optimizer.
Then, in every repetition, in an order rotated by one per repetition, each in a child
process of its own (timed inside it, after its imports; the export's child first exports a
tiny checkpoint, so that torch's code is paged in and the timing is of the export's I/O):

- export: `export(ckpt, dst, max_shard_bytes=<half the model>)` to safetensors: the check of
  every file against the manifest, the reads, the writes, each file fsynced;
- copy: every file of the checkpoint's step directory (data files, .metadata, manifest)
  copied with `shutil.copyfile` and fsynced: the same bytes read and written, with the same
  durability as the export, by the plainest means. `copy_nofsync_s` is the same without the
  fsync, for orientation.

`export_over_copy` = copy_s / export_s (paired, see below; target >= 0.8). The export's
child reports its peak RSS (VmHWM; not ru_maxrss, which a child inherits from its parent's
peak) minus its RSS after importing torch and resilient and the warm-up, before the export:
`peak_rss_over_bound` = that / (max_shard_bytes + largest tensor), with the shard cap at
half the model, so the bound is below the model's size (target <= 1.5).

S3 (`--s3-mib`, 256 by default, 0 to skip): moto's server in a child process on loopback
(fake credentials; nothing leaves the machine), a checkpoint of 64 MiB layers uploaded once.
export: the same export from s3://; get: one s3fs `cat_file` (a plain GET) of every object
of the step directory, in a child process too. `s3_export_over_get` = get_s / export_s.

Each child imports torch and resilient (the copy's and the GET's too), then, right before
its timing, writes back every dirty page, so no variant pays for the one before it. Two
states of the page cache (`--cache`): `cold` (the top-level figures), where each child also
drops the page cache (root only; `page_cache_dropped` says) and so reads the checkpoint from
the disk, as an export after training does (a save drops its pages behind it); and `warm`
(`*_warm`), with the checkpoint in the page cache, as after a save with
keep_in_page_cache=True. The S3 part runs cold.
Ratios are paired: each repetition's against the baseline of the
same repetition, then the median. With several sizes, the top-level ratios are the worst over
sizes; `sizes` holds each size's figures. The last line of stdout is one JSON object. Files
go under `bench-output/export/` (git-ignored) unless `--dir`, and are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MIB = 1 << 20
LAYER = 8192  # 8192 x 8192 fp32: 256 MiB a layer
_SERVER = """
import logging, sys
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""


# ---------------------------------------------------------------------- child processes
def child(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One timed operation in this (child) process; its figures as a dict."""
    import psutil

    if kind == "export":
        import torch

        from resilient.log import configure
        from resilient.weights.export import export

        configure(run_dir=None, run_id="bench", rank=0, restart=0, console_level="ERROR")
        if spec.get("warmup"):  # torch's code paths loaded, so the timing is of the I/O
            export(spec["warmup"], spec["dst"] + ".warmup", progress=False)
            shutil.rmtree(spec["dst"] + ".warmup")
        dropped = settle(spec["drop"])
        baseline = psutil.Process().memory_info().rss
        t = time.perf_counter()
        r = export(
            spec["src"],
            spec["dst"],
            max_shard_bytes=spec["max_shard_bytes"],
            storage_options=spec.get("storage_options"),
            progress=False,
        )
        seconds = time.perf_counter() - t
        peak = _vm_hwm()
        return {
            "s": seconds,
            "bytes": r.bytes,
            "files": len(r.files),
            "verify_s": r.verify_s,
            "read_s": r.read_s,
            "write_s": r.write_s,
            "rss_baseline": baseline,
            "rss_peak": peak,
            "dropped": dropped,
        }
    if kind == "copy":
        import torch

        import resilient.weights.export

        src, dst = Path(spec["src"]), Path(spec["dst"])
        dst.mkdir(parents=True)
        dropped = settle(spec["drop"])
        t = time.perf_counter()
        total = 0
        for f in sorted(src.iterdir()):
            shutil.copyfile(f, dst / f.name)
            if spec["fsync"]:
                fd = os.open(dst / f.name, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            total += f.stat().st_size
        if spec["fsync"]:
            fd = os.open(dst, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        return {"s": time.perf_counter() - t, "bytes": total, "dropped": dropped}
    if kind == "get":
        import s3fs
        import torch  # noqa: F401  (the same process as the export's: torch imported)

        import resilient.weights.export  # noqa: F401

        fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
        settle(spec["drop"])
        t = time.perf_counter()
        total = 0
        for key in sorted(fs.find(spec["prefix"])):
            total += len(fs.cat_file(key))
        return {"s": time.perf_counter() - t, "bytes": total}
    raise SystemExit(f"unknown child {kind!r}")


def _vm_hwm() -> int:
    """This process's peak RSS in bytes (VmHWM). Not ru_maxrss: a child's ru_maxrss starts at
    its parent's peak at fork (Linux keeps it across exec), here the parent's model."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_child(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if out.returncode != 0:
        raise RuntimeError(f"{kind} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


# ---------------------------------------------------------------------- set-up
def build_checkpoint(url: str, layers: int, width: int, storage_options: Any = None) -> int:
    """A single-process save of `layers` Linear(width, width) layers, fp32; its bytes."""
    import torch
    from torch import nn

    from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState

    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.01, 0.01)
    config = CheckpointConfig(url=url, async_save=False, storage_options=storage_options or {})
    mgr = CheckpointManager(config)
    mgr.save(TrainState(model=model, rng=False), 1)
    mgr.close()
    return layers * width * width * 4


def settle(drop: bool = True) -> bool:
    """Write back every dirty page, so no variant pays for the one before it, and (`drop`)
    drop the page cache where allowed (root), so each reads the checkpoint from the disk, as
    an export after training does (a save drops its pages behind it). Whether it dropped."""
    os.sync()
    if not drop:
        return False
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def median(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


# ---------------------------------------------------------------------- benchmarks
def bench_local(base: Path, gib: int, reps: int, caches: list[str]) -> dict[str, Any]:
    layers = 4 * gib
    ckpt = base / f"ckpt_{gib}g"
    tiny = base / "tiny"
    if not tiny.exists():
        build_checkpoint(str(tiny), 2, 64)
    t = time.perf_counter()
    model_bytes = build_checkpoint(str(ckpt), layers, LAYER)
    print(f"# {gib} GiB checkpoint built in {time.perf_counter() - t:.1f} s", flush=True)
    out = {
        "model_bytes": model_bytes,
        "max_shard_bytes": model_bytes // 2,
        "largest_tensor_bytes": LAYER * LAYER * 4,
    }
    for cache in caches:
        out[cache] = _local_runs(base, ckpt, tiny, gib, reps, out, drop=cache == "cold")
    shutil.rmtree(ckpt)
    return out


def _local_runs(
    base: Path, ckpt: Path, tiny: Path, gib: int, reps: int, sizes: dict[str, int], *, drop: bool
) -> dict[str, Any]:
    step = ckpt / "step_000000001"
    # Read once, untimed: in the page cache for `warm`; for `cold`, so that the first
    # variant of the first repetition is not the one that pays for the first read of a new
    # file (on this VM, from behind the host's own cache: 9-14 s for 4 GiB against 2-4 s).
    for f in step.iterdir():
        with open(f, "rb") as fh:
            while fh.read(64 * MIB):
                pass
    shard = sizes["max_shard_bytes"]
    runs: dict[str, list[dict[str, Any]]] = {"export": [], "copy": [], "copy_nofsync": []}
    order = list(runs)
    for rep in range(reps):
        for kind in order[rep % len(order) :] + order[: rep % len(order)]:
            dst = base / f"out_{kind}"
            if kind == "export":
                spec = {
                    "src": str(ckpt),
                    "dst": str(dst),
                    "max_shard_bytes": shard,
                    "warmup": str(tiny),
                    "drop": drop,
                }
                got = run_child("export", spec)
            else:
                spec = {"src": str(step), "dst": str(dst), "fsync": kind == "copy", "drop": drop}
                got = run_child("copy", spec)
            shutil.rmtree(dst)
            runs[kind].append(got)
            cache = "cold" if drop else "warm"
            print(f"# {gib} GiB {cache} rep {rep + 1} {kind}: {json.dumps(got)}", flush=True)
    export_s, copy_s = median(runs["export"], "s"), median(runs["copy"], "s")
    paired = [c["s"] / e["s"] for c, e in zip(runs["copy"], runs["export"], strict=True)]
    peak = max(r["rss_peak"] - r["rss_baseline"] for r in runs["export"])
    return {
        "checkpoint_bytes": runs["copy"][0]["bytes"],
        "export_s": round(export_s, 3),
        "copy_s": round(copy_s, 3),
        "copy_nofsync_s": round(median(runs["copy_nofsync"], "s"), 3),
        "export_over_copy": round(statistics.median(paired), 3),
        "export_over_copy_each": [round(x, 3) for x in paired],
        "page_cache_dropped": all(r["dropped"] for rs in runs.values() for r in rs),
        "export_parts_s": {
            k: round(median(runs["export"], k), 3) for k in ("verify_s", "read_s", "write_s")
        },
        "export_gb_per_s": round(sizes["model_bytes"] / export_s / 1e9, 3),
        "peak_rss_bytes": peak,
        "rss_baseline_bytes": runs["export"][0]["rss_baseline"],
        "peak_rss_over_bound": round(peak / (shard + sizes["largest_tensor_bytes"]), 3),
        "all_export_s": [round(r["s"], 3) for r in runs["export"]],
        "all_copy_s": [round(r["s"], 3) for r in runs["copy"]],
    }


def bench_s3(base: Path, mib: int, reps: int) -> dict[str, Any]:
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        os.environ.update(
            AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
            AWS_ACCESS_KEY_ID="bench-key",
            AWS_SECRET_ACCESS_KEY="bench-secret",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_EC2_METADATA_DISABLED="true",
        )
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            os.environ.pop(var, None)
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).mkdir("bench-export")
        width = 4096  # 64 MiB a layer
        layers = max(1, mib * MIB // (width * width * 4))
        url = "s3://bench-export/ckpt"
        if not (base / "tiny").exists():
            build_checkpoint(str(base / "tiny"), 2, 64)
        model_bytes = build_checkpoint(url, layers, width)
        runs: dict[str, list[dict[str, Any]]] = {"export": [], "get": []}
        for rep in range(reps):
            for kind in ("export", "get") if rep % 2 == 0 else ("get", "export"):
                if kind == "export":
                    dst = base / "out_s3"
                    spec = {
                        "src": url,
                        "dst": str(dst),
                        "max_shard_bytes": 5_000_000_000,
                        "warmup": str(base / "tiny"),
                        "drop": True,
                    }
                    got = run_child("export", spec)
                    shutil.rmtree(dst)
                else:
                    got = run_child(
                        "get", {"prefix": "bench-export/ckpt/step_000000001", "drop": True}
                    )
                runs[kind].append(got)
                print(f"# s3 {mib} MiB rep {rep + 1} {kind}: {json.dumps(got)}", flush=True)
        export_s, get_s = median(runs["export"], "s"), median(runs["get"], "s")
        paired = [g["s"] / e["s"] for g, e in zip(runs["get"], runs["export"], strict=True)]
        return {
            "s3_model_bytes": model_bytes,
            "s3_export_s": round(export_s, 3),
            "s3_get_s": round(get_s, 3),
            "s3_export_over_get": round(statistics.median(paired), 3),
            "s3_export_over_get_each": [round(x, 3) for x in paired],
            "s3_export_parts_s": {
                k: round(median(runs["export"], k), 3) for k in ("verify_s", "read_s", "write_s")
            },
        }
    finally:
        if server.stdin:
            server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1", help="checkpoint sizes in GiB, comma-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--cache",
        default="cold,warm",
        help="cold: the page cache dropped before each variant (root); warm: the "
        "checkpoint in the page cache; either or both",
    )
    p.add_argument("--s3-mib", type=int, default=256, help="S3 checkpoint size (0: skip)")
    p.add_argument("--dir", default=str(REPO / "bench-output" / "export"))
    p.add_argument("--child", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], json.loads(args.child[1]))))
        return
    base = Path(args.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    try:
        caches = args.cache.split(",")
        sizes = {
            f"{g}GiB": bench_local(base, int(g), args.reps, caches) for g in args.sizes.split(",")
        }
        result: dict[str, Any] = {"bench": "export", "reps": args.reps}
        for cache in caches:
            tag = "" if cache == "cold" else f"_{cache}"
            result[f"export_over_copy{tag}"] = min(
                s[cache]["export_over_copy"] for s in sizes.values()
            )
            result[f"peak_rss_over_bound{tag}"] = max(
                s[cache]["peak_rss_over_bound"] for s in sizes.values()
            )
        if args.s3_mib > 0:
            result.update(bench_s3(base, args.s3_mib, args.reps))
        result["sizes"] = sizes
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
