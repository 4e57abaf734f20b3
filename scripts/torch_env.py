"""A side environment with another torch release, for `make test-torch TORCH=<version>`.

    .venv/bin/python scripts/torch_env.py 2.15.0         # build (or reuse); prints its python
    .venv/bin/python scripts/torch_env.py 2.15.0 --run -- -m pytest -q tests/test_hot.py

The environment is a venv in a cache directory outside the checkout,
`${RESILIENT_CACHE:-~/.cache/resilient}/torch-<version>-py<X.Y>/`, so every clone on the
machine reuses it; a fresh machine builds it. It holds only torch and the CUDA libraries torch
links at import (torch's Linux wheels on PyPI are CUDA builds; they run on CPU): every other
package comes from the checkout's `.venv`, whose site-packages a `.pth` file appends to the
side venv's path (torch's own copy is found first). The tests then run against the
dependencies CI installs, with only torch changed, and the environment costs no second copy
of them. Left out of torch's CUDA dependencies, as never loaded on CPU: triton (the
torch.compile code generator), the CUDA Python bindings, cuSOLVER (loaded with GPU linear
algebra), CUPTI, NVTX and the CUDA headers (cccl). If `import torch` still misses a library,
the left-out NVIDIA ones are added and the check is run again.

A build goes to a temporary directory and is renamed into place once `import torch` gives
the asked release, gloo works and `.venv` satisfies torch's own requirements: a failed or
interrupted build leaves nothing behind that looks ready. Failures name what failed and exit
with status 2: no network or no such release (the package index's own words are shown).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE_VAR = "RESILIENT_TORCH_ENV_BASE"
"""The site-packages the side venv appends to its path (set by --run; the one recorded at
build time when unset)."""
SKIP = {
    "triton",
    "cuda-bindings",
    "cuda-pathfinder",
    "nvidia-cusolver",
    "nvidia-cusolver-cu12",
    "nvidia-cuda-cupti",
    "nvidia-cuda-cupti-cu12",
    "nvidia-nvtx",
    "nvidia-nvtx-cu12",
    "nvidia-cuda-cccl",
}
DEMO_ARGS = ["--steps", "20", "--save-every", "5", "--kill-after", "5"]
"""make demo's proof (kill a rank, resume, same digest bit for bit) on a shorter run: a kill
after the checkpoint of step 5 or 10, a restart, a resume, about 38 s."""
SUBSET = [
    "tests/test_torch_compat.py",
    "tests/test_checkpoint.py",
    "--deselect",  # page-cache residency of an 800 MB save: the kernel's, not torch's
    "tests/test_checkpoint.py::test_a_local_save_drops_its_pages_behind_it_unless_told_to_keep_them",
    "tests/test_reshard.py::test_reshard_is_bitwise_exact[4fsdp-to-2ddp]",
    "tests/test_hot.py::test_a_killed_rank_is_replaced_hot_and_the_run_ends_bit_exact[2-1-1]",
    "tests/test_numeric.py::test_a_nan_and_a_spike_roll_back_in_place_bit_for_bit",
    "tests/test_supervisor.py",
    "tests/test_hang.py::test_killed_rank_peers_leave_within_the_heartbeat_timeout[none]",
    "tests/test_export.py::test_safetensors_writer_streams_what_safe_open_reads",
    "tests/test_export.py::test_hugging_face_from_pretrained_reads_an_export",
    "tests/test_pipeline.py::test_a_killed_stage_rank_resumes_cold_bit_for_bit[1f1b]",
    "tests/test_pipeline.py::test_micro_batches_that_do_not_divide_the_batch_are_refused",
]
"""The compatibility subset (docs/operating.md#torch-releases): every private name's user and
each torch behaviour resilient relies on, once: DCP save, load and verification
(test_checkpoint), resharding FSDP2 to DDP, a hot replacement (torch elastic's process
context), a NaN and a spike rolled back in place, the supervisor's restarts (torch elastic's
agent and torchrun's parser), gloo's peer-loss errors, lazy gloo groups, an export read by
transformers, and a pipeline's resume and its refusal of uneven micro-batches (torch's
pipelining changed much between 2.12 and 2.13)."""
XDIST = ["-n", "2", "--dist", "loadfile"]
LAYOUT = 1  # bump when what a side environment holds changes: older ones are rebuilt


class BuildError(Exception):
    pass


def _pip(python: str, *args: str, version: str) -> subprocess.CompletedProcess[str]:
    """pip of the base venv, for `python`'s environment. A machine's pip configuration may cap
    torch (a constraints file); this one release is asked for explicitly, so the constraint
    option is replaced by one naming it, for this call only."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(f"torch=={version}\n")
    env = {**os.environ, "PIP_CONSTRAINT": f.name, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    try:
        return subprocess.run(
            [sys.executable, "-m", "pip", "--python", python, *args],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        os.unlink(f.name)


def _fail(what: str, proc: subprocess.CompletedProcess[str]) -> BuildError:
    """`what` failed: pip's own words, its errors and network retries first."""
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "is ignored" not in ln]
    words = ("ERROR", "Retrying", "Could not", "onnection", "Name or service")
    said = [ln for ln in lines if any(w in ln for w in words)]
    tail = "\n    ".join((said or lines)[-8:])
    return BuildError(f"{what} (pip exited {proc.returncode}):\n    {tail}")


def resolve(version: str, python: str) -> tuple[dict[str, str], list[str]]:
    """Every package pip resolves for torch `version` on this platform (name -> version), and
    torch's own requirements (metadata only: nothing is downloaded yet)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp, "report.json")
        args = ("install", "--dry-run", "--ignore-installed", "--report", str(report))
        proc = _pip(python, *args, f"torch=={version}", version=version)
        if proc.returncode != 0:
            raise _fail(
                f"could not resolve torch=={version} on the package index (no network, or no "
                "such release for this Python and platform)",
                proc,
            )
        found = json.loads(report.read_text())["install"]
    pins = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in found}
    (meta,) = [i["metadata"] for i in found if i["metadata"]["name"].lower() == "torch"]
    return pins, list(meta.get("requires_dist", []))


def needed(pins: dict[str, str], requires: list[str]) -> list[str]:
    """`name==version` of torch, the CUDA libraries it loads at import, and those of its
    other requirements that the base .venv (this interpreter) does not meet."""
    from importlib import metadata

    from packaging.requirements import Requirement

    keep = ["torch"]
    keep += [n for n in pins if n.startswith(("nvidia-", "cuda-")) and n not in SKIP]
    for req in map(Requirement, requires):
        name = req.name.lower()
        if name in keep or name in SKIP or name not in pins:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have: str | None = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            print(f"torch-env: torch {pins['torch']} needs {req} (.venv has {have})", flush=True)
            keep.append(name)
    return [f"{n}=={pins[n]}" for n in keep]


def left_out_nvidia(pins: dict[str, str]) -> list[str]:
    """The NVIDIA libraries `needed` leaves out (the fallback when import misses one)."""
    return [f"{n}=={v}" for n, v in pins.items() if n in SKIP and n.startswith("nvidia-")]


CHECK = """
import sys, torch, torch.distributed as dist
want = sys.argv[1]
got = torch.__version__.split("+")[0]
assert got == want, f"import torch gave {torch.__version__} from {torch.__file__}, not {want}"
assert dist.is_available() and dist.is_gloo_available(), "torch.distributed/gloo missing"
print(torch.__version__)
"""


def check(python: Path, version: str, base: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, BASE_VAR: base}
    args = [str(python), "-c", CHECK, version]
    return subprocess.run(args, env=env, capture_output=True, text=True, check=False)


def install(python: str, pins: list[str], wheels: Path, version: str) -> tuple[float, int]:
    """Download `pins` into `wheels` (kept there until the environment is ready, so that a
    failed build does not download them again), then install them from there; returns the
    download's seconds and bytes."""
    t0 = time.monotonic()
    args = ("download", "--no-deps", "--only-binary", ":all:", "-d", str(wheels))
    proc = _pip(python, *args, *pins, version=version)
    if proc.returncode != 0:
        raise _fail(
            f"could not download {len(pins)} wheels for torch=={version} (no network?)", proc
        )
    took = time.monotonic() - t0
    names = {p.split("==")[0].replace("-", "_").lower() + "-" + p.split("==")[1] for p in pins}
    size = sum(
        f.stat().st_size
        for f in wheels.glob("*.whl")
        if "-".join(f.name.split("-")[:2]).lower() in names
    )
    args = ("install", "--no-deps", "--no-index", "--find-links", str(wheels))
    proc = _pip(python, *args, *pins, version=version)
    if proc.returncode != 0:
        raise _fail(f"could not install the wheels of torch=={version}", proc)
    return took, size


def build(version: str, target: Path, base: str) -> dict[str, object]:
    """Build the side environment for `version` at `target`; returns what it measured."""
    started = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    wheels = target.parent / f"wheels-{version}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{target.name}.building-", dir=target.parent))
    try:
        subprocess.run(
            [sys._base_executable, "-m", "venv", "--without-pip", str(tmp)],  # type: ignore[attr-defined]
            check=True,
        )
        python = str(tmp / "bin" / "python")
        resolved, requires = resolve(version, python)
        pins = needed(resolved, requires)
        print(f"torch-env: {len(pins)} wheels: {' '.join(pins)}", flush=True)
        download_s, download_bytes = install(python, pins, wheels, version)
        site = Path(
            subprocess.check_output(
                [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                text=True,
            ).strip()
        )
        (site / "_resilient_base.pth").write_text(
            "import os, site; p = os.environ.get("
            f"{BASE_VAR!r}) or {base!r}; os.path.isdir(p) and site.addsitedir(p)\n"
        )
        ok = check(tmp / "bin" / "python", version, base)
        if ok.returncode != 0 and "cannot open shared object" in ok.stderr:
            extra = left_out_nvidia(resolved)
            print(f"torch-env: import needs more CUDA libraries, adding {extra}", flush=True)
            took, size = install(python, extra, wheels, version)
            download_s, download_bytes, pins = (
                download_s + took,
                download_bytes + size,
                pins + extra,
            )
            ok = check(tmp / "bin" / "python", version, base)
        if ok.returncode != 0:
            raise BuildError(f"torch {version} does not import there:\n{ok.stderr[-2000:]}")
        info = {
            "torch": ok.stdout.strip(),
            "layout": LAYOUT,
            "wheels": pins,
            "download_s": round(download_s, 1),
            "download_bytes": download_bytes,
            "build_s": round(time.monotonic() - started, 1),
            "size_bytes": sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()),
        }
        (tmp / "resilient-torch-env.json").write_text(json.dumps(info, indent=1) + "\n")
        if target.exists():  # an older layout
            shutil.rmtree(target)
        tmp.rename(target)
        shutil.rmtree(wheels, ignore_errors=True)
        return info
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def declared(end: str) -> str:
    """The floor or the newest tested release, as X.Y.Z: TORCH_FLOOR and TORCH_NEWEST of
    resilient/_torch_check.py, the one place they are named (read as text: importing the
    package would import the checkout's torch). pyproject.toml's bound (`<2.16`) names a
    minor, not the release tested."""
    import ast

    name = "TORCH_FLOOR" if end == "floor" else "TORCH_NEWEST"
    tree = ast.parse((REPO / "resilient" / "_torch_check.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
            name
        ]:
            return ".".join(map(str, ast.literal_eval(node.value)))
    raise SystemExit(f"torch-env: resilient/_torch_check.py names no {name}")


def env_dir(version: str) -> Path:
    cache = Path(os.environ.get("RESILIENT_CACHE") or Path.home() / ".cache" / "resilient")
    return cache / f"torch-{version}-py{sys.version_info.major}.{sys.version_info.minor}"


def ready(target: Path) -> dict[str, object] | None:
    try:
        info = json.loads((target / "resilient-torch-env.json").read_text())
    except (OSError, ValueError):
        return None
    return info if info.get("layout") == LAYOUT else None


@contextlib.contextmanager
def _building(target: Path) -> Iterator[None]:
    """Hold the environment's lock: one build at a time per environment on this machine
    (a prefetch in the background and the subset that waits for it, or two checkouts)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def prefetch(version: str, target: Path) -> int:
    """Start building (or checking) the environment in a detached process, so that the
    download overlaps other work; a later call waits for it through the lock. The child takes
    the lock before this returns, so that call cannot slip in first."""
    if ready(target) is not None:
        print(f"torch-env: {target} is ready (torch {version})", flush=True)
        return 0
    log = Path(f"{target}.log")
    target.parent.mkdir(parents=True, exist_ok=True)
    # at the lowest CPU and I/O priority: it fills the suite's idle time instead of competing
    # with it (two builds at normal priority beside the suite doubled the suite's time here)
    lowest = [*(["nice", "-n", "19"] if shutil.which("nice") else [])]
    lowest += ["ionice", "-c", "3"] if shutil.which("ionice") else []
    with open(log, "w") as out:
        child = subprocess.Popen(
            [*lowest, sys.executable, __file__, version],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO,
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and child.poll() is None:
        said = log.read_text()
        if "building" in said or "reusing" in said:
            break  # it holds the lock (it prints under it)
        time.sleep(0.1)
    print(f"torch-env: building torch {version} in the background (pid {child.pid}, {log})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "version", help="a torch release (2.15.0), or the range's `floor` or `newest`"
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--run", nargs=argparse.REMAINDER, help="run its python with these args")
    what.add_argument("--subset", action="store_true", help="run the compatibility subset")
    parser.add_argument(
        "--no-demo",
        action="store_true",
        help="with --subset: the tests only, not the shortened demo before them",
    )
    what.add_argument(
        "--prefetch",
        action="store_true",
        help="build (or reuse) it in a background process and return at once; its output goes "
        "to <environment>.log beside it",
    )
    parser.add_argument(
        "--untested-if-unbuildable",
        action="store_true",
        help="(make test) where the environment cannot be built (no network, no disk, no such "
        "release), say loudly that this release went untested and exit 0; test failures "
        "still fail",
    )
    args = parser.parse_args(argv)
    if sys.prefix == sys.base_prefix:
        print("torch-env: run me with the checkout's .venv/bin/python", file=sys.stderr)
        return 2
    if args.version in ("floor", "newest"):
        args.version = declared(args.version)
    base = sysconfig.get_path("purelib")
    target = env_dir(args.version)
    if args.prefetch:
        return prefetch(args.version, target)
    with _building(target):  # a prefetch still at work: wait for it, then reuse its result
        info = ready(target)
        if info is None:
            print(f"torch-env: building {target} (downloads torch {args.version})", flush=True)
            try:
                info = build(args.version, target, base)
            except (BuildError, OSError) as e:
                print(f"torch-env: FAILED to build the torch {args.version} environment: {e}")
                if args.untested_if_unbuildable:
                    print(
                        f"torch-env: *** torch {args.version} was NOT TESTED: its environment "
                        f"could not be built here (above). Run `make test-torch "
                        f"TORCH={args.version}` where it can be. ***",
                        flush=True,
                    )
                    return 0
                return 2
            print(f"torch-env: built in {info['build_s']} s, {info['size_bytes'] / 1e9:.2f} GB")
        else:
            print(f"torch-env: reusing {target} (torch {info['torch']})", flush=True)
    python = str(target / "bin" / "python")
    env = {**os.environ, BASE_VAR: base}
    if args.subset:
        return subset(python, env, str(info["torch"]), demo=not args.no_demo)
    if args.run is None:
        print(python)
        return 0
    cmd = [python, *(args.run[1:] if args.run[:1] == ["--"] else args.run)]
    return subprocess.run(cmd, env=env, cwd=REPO, check=False).returncode


def subset(python: str, env: dict[str, str], torch_version: str, *, demo: bool = True) -> int:
    """The demo (unless not `demo`), then SUBSET under pytest, with this torch; the first
    failure's status."""
    with tempfile.TemporaryDirectory(prefix="resilient-torch-subset-") as out:
        basetemp = ["--basetemp", str(Path(out, "pytest"))]
        steps = [
            ("demo", [python, "-m", "chaos.demo", *DEMO_ARGS, "--out", str(Path(out, "demo"))]),
            # its own --basetemp: pytest sessions of other checkouts prune the shared
            # /tmp/pytest-of-<user>/pytest-<n> directories, this one's included; on two
            # workers, as make test runs the suite (44 s against 78 s on one here)
            (
                "tests",
                [python, "-m", "pytest", "-q", *XDIST, "-m", "not extended", *basetemp, *SUBSET],
            ),
        ]
        for name, cmd in steps if demo else steps[1:]:
            print(f"torch-env: torch {torch_version}: {name}: {' '.join(cmd[1:])}", flush=True)
            t0 = time.monotonic()
            rc = subprocess.run(cmd, env=env, cwd=REPO, check=False).returncode
            took = time.monotonic() - t0
            print(
                f"torch-env: torch {torch_version}: {name} exited {rc} in {took:.0f} s", flush=True
            )
            if rc != 0:
                return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
