"""Node health checks (resilient/health/) on real parts: checkpoints written by
CheckpointManager on a local disk and on moto's S3 server, a closed port, real commands,
/dev/shm and host memory as they are here, worker events written through resilient's own
event log, and a stand-in pynvml module in a real subprocess."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
from helpers import REPO_ROOT, free_port
from trainee import Trainee

from resilient import CheckpointConfig, CheckpointManager
from resilient.checkpoint.manifest import MANIFEST_NAME, FileEntry, read_manifest, step_dir
from resilient.events import read_events
from resilient.health import CheckResult, HealthInputs, HealthReport, check_node
from resilient.health.host import LOG_HEAD, LOG_TAIL, SHM_PATH, SHM_PER_RANK
from resilient.health.report import fmt_bytes
from resilient.health.storage import PROBE_BUDGET_S
from resilient.log import EventLog, open_event_log
from resilient.proctree import alive
from resilient.storage import RetryPolicy, Storage

if TYPE_CHECKING:  # imported by pytest as a plugin (see tests/test_s3.py)
    from s3_fixtures import S3Env

pytest_plugins = ["s3_fixtures"]  # moto_endpoint, s3

NAMES = [
    "checkpoint_reachable",
    "checkpoint_space",
    "shm",
    "host_memory",
    "gpu",
    "user_command",
]
FAST = RetryPolicy(initial_wait_s=0.01, max_wait_s=0.05, jitter_s=0.01, budget_s=20)


# ------------------------------------------------------------------------------ helpers
def run_checks(tmp_path: Path, **kw: Any) -> tuple[HealthReport, list[dict[str, Any]]]:
    """check_node with a real event log; the report and the events it logged."""
    kw.setdefault("run_dir", str(tmp_path / "run"))
    kw.setdefault("checkpoint_url", None)
    kw.setdefault("nproc_per_node", 1)
    path = tmp_path / "run" / "logs" / f"supervisor-{time.monotonic_ns()}.jsonl"
    log = open_event_log(path, static={"source": "supervisor"}, console_level="CRITICAL")
    try:
        report = check_node(HealthInputs(**kw), log)
    finally:
        log.close()
    return report, read_events(path)


def by_name(report: HealthReport) -> dict[str, CheckResult]:
    assert [c.name for c in report.checks] == NAMES
    return {c.name: c for c in report.checks}


def save_checkpoint(url: str, step: int = 2, **kw: Any) -> int:
    """A real committed checkpoint of a small model at `step`; its manifest's total bytes."""
    t = Trainee(0, widths=(64, 64, 3))
    t.train(1)
    mgr = CheckpointManager(CheckpointConfig(url=url, async_save=False, **kw))
    mgr.save(t.state(), step=step)
    total = mgr.read_manifest(step).total_bytes
    mgr.close()
    return total


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root` with its size and mtime (the root's own mtime left out: the
    probe is created and deleted there)."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def snapshot_event(run_dir: Path, rank: int, restart: int, per_copy: int) -> None:
    """A worker's snapshot.memory event, through resilient's own event log, as
    resilient/memory/snapshot.py writes it at track()."""
    log = EventLog(
        run_dir / "logs" / f"rank{rank}.jsonl",
        static={"run_id": "r", "rank": rank, "restart": restart, "pid": 1},
        console_level="CRITICAL",
    )
    log.info("train.progress", first=1, last=2)
    log.info(
        "snapshot.memory",
        bytes_per_copy=per_copy,
        copies=2,
        total_bytes=2 * per_copy,
        available_bytes=1 << 40,
        every_steps="adaptive",
    )
    log.close()


# ------------------------------------------------------------------------------ the report
@pytest.mark.timeout(30)
def test_every_check_is_logged_and_a_clean_node_passes(tmp_path: Path) -> None:
    report, events = run_checks(tmp_path)
    checks = by_name(report)
    assert report.ok and report.failed == () and report.summary() == ""
    assert checks["checkpoint_reachable"].skipped and checks["checkpoint_space"].skipped
    assert checks["user_command"].value == "no --health-check command given"
    assert [e["name"] for e in events if e["event"] == "health.check"] == NAMES
    for e in events[:-1]:
        assert {"name", "ok", "skipped", "value", "threshold", "seconds"} <= set(e)
    assert events[-1]["event"] == "health.done"
    assert events[-1]["ok"] is True and events[-1]["failed"] == []
    assert report.to_json()["checks"][2] == {
        **dataclasses.asdict(checks["shm"]),
        "seconds": round(checks["shm"].seconds, 4),
    }
    assert report.seconds < 2.0


@pytest.mark.timeout(60)
def test_the_package_loads_no_checkpoint_code_and_no_supervisor() -> None:
    code = (
        "import sys, resilient.health\n"
        "print(sorted(m for m in sys.modules if m.startswith(('resilient.checkpoint', "
        "'resilient.supervisor', 'torch'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------ checkpoints
@pytest.mark.timeout(60)
def test_a_local_checkpoint_is_sized_and_the_probe_leaves_no_trace(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    total = save_checkpoint(str(root))
    before = tree(root)
    report, _ = run_checks(tmp_path, checkpoint_url=str(root))
    checks = by_name(report)
    assert report.ok, report.summary()
    space = checks["checkpoint_space"]
    free = shutil.disk_usage(root).free
    assert space.threshold == (
        f"≥ {fmt_bytes(total)} free: newest checkpoint step 2 is {fmt_bytes(total)}"
    )
    assert space.value.startswith("writable, ") and space.value.endswith(" free")
    shown = float(space.value.split(", ")[1].split()[0])
    assert abs(shown * 2**30 - free) < 0.2 * 2**30  # GiB here, to one decimal
    assert checks["checkpoint_reachable"].value.startswith("answered in ")
    assert tree(root) == before  # nothing left behind, nothing inside step_2 touched
    assert report.seconds < 2.0


@pytest.mark.timeout(60)
def test_a_newest_checkpoint_bigger_than_the_free_space_fails(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    save_checkpoint(str(root))
    storage = Storage(str(root))
    m = read_manifest(storage, 2)
    shutil.copytree(root / step_dir(2), root / step_dir(4))
    need = shutil.disk_usage(root).free + (1 << 40)  # 1 TiB more than the disk has free
    files = dict(m.files)
    name = max(files, key=lambda n: files[n].size)
    files[name] = FileEntry(size=need - (m.total_bytes - files[name].size), checksum=1)
    big = dataclasses.replace(m, step=4, files=files)
    (root / step_dir(4) / MANIFEST_NAME).write_bytes(big.to_json())
    (root / step_dir(6)).mkdir()  # an unfinished save: no manifest, not a checkpoint
    (root / step_dir(6) / "__0_0.distcp").write_bytes(b"x" * 10)
    (root / "notes.txt").write_text("not a checkpoint")

    report, events = run_checks(tmp_path, checkpoint_url=str(root))
    checks = by_name(report)
    assert [c.name for c in report.failed] == ["checkpoint_space"]
    space = checks["checkpoint_space"]
    assert big.total_bytes == need
    assert space.threshold == f"≥ {fmt_bytes(need)} free: newest checkpoint step 4 is " + (
        fmt_bytes(need)
    )
    assert space.value.startswith("writable, ")
    assert str(root) in space.detail and "larger one" in space.detail
    assert report.summary() == (
        f"checkpoint_space: {space.value} (needs {space.threshold}); {space.detail}"
    )
    done = events[-1]
    assert done["event"] == "health.done" and done["failed"] == ["checkpoint_space"]
    (logged,) = [e for e in events if e.get("name") == "checkpoint_space"]
    assert logged["level"] == "warning" and logged["ok"] is False
    assert logged["detail"] == space.detail


@pytest.mark.timeout(30)
def test_a_location_that_refuses_writes_fails(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    if subprocess.run(["chattr", "+i", str(root)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i (an immutable directory) is not available here")
    try:
        report, _ = run_checks(tmp_path, checkpoint_url=str(root))
    finally:
        subprocess.run(["chattr", "-i", str(root)], check=True)
    checks = by_name(report)
    assert [c.name for c in report.failed] == ["checkpoint_space"]
    space = checks["checkpoint_space"]
    assert space.value.startswith("not writable (PermissionError: ")
    assert (space.threshold, checks["checkpoint_reachable"].ok) == ("a writable location", True)
    assert f"checkpoint location {str(root)!r} is not writable" in space.detail
    assert list(root.iterdir()) == []


FULL_DISK = (
    "import json, os, sys\n"
    "from resilient.health import HealthInputs, check_node\n"
    "from resilient.log import EventLog\n"
    "r = check_node(HealthInputs(run_dir=sys.argv[2], checkpoint_url=sys.argv[1],"
    " nproc_per_node=1), EventLog(console_level='CRITICAL'))\n"
    "print(json.dumps({'report': r.to_json(), 'left': sorted(os.listdir(sys.argv[1]))}))\n"
)


@pytest.mark.timeout(60)
def test_a_full_disk_fails_and_keeps_no_half_written_probe(tmp_path: Path) -> None:
    """A 256 KiB tmpfs filled to the last byte, mounted on the location in a mount namespace
    of the check's own."""
    root = tmp_path / "ckpt"
    root.mkdir()
    fill = f"mount -t tmpfs -o size=256k tmpfs {root} && (dd if=/dev/zero of={root}/fill bs=64k"
    wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
    probe = subprocess.run([*wrap, f"mount -t tmpfs tmpfs {root}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mounts here: {probe.stderr.decode()[-200:]}")
    script = fill + ' 2>/dev/null || true) && exec "$@"'
    out = subprocess.run(
        [*wrap, script, "sh", sys.executable, "-c", FULL_DISK, str(root), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["report"]["failed"] == ["checkpoint_space"]
    (space,) = [c for c in got["report"]["checks"] if c["name"] == "checkpoint_space"]
    assert space["value"].startswith("not writable (OSError: [Errno 28] No space left on device")
    assert got["left"] == ["fill"]  # the probe's temporary file went again


@pytest.mark.timeout(60)
def test_an_s3_location_with_a_checkpoint_passes_and_keeps_no_probe(
    s3: S3Env, tmp_path: Path
) -> None:
    total = save_checkpoint(s3.url(), retry=FAST)
    before = s3.objects()
    report, _ = run_checks(tmp_path, checkpoint_url=s3.url())
    checks = by_name(report)
    assert report.ok, report.summary()
    space = checks["checkpoint_space"]
    assert space.value == "writable; free space not measured: object stores have no such limit"
    assert f"newest checkpoint step 2 is {fmt_bytes(total)}" in space.threshold
    assert s3.objects() == before  # the probe object is gone again
    assert not any(secret in json.dumps(report.to_json()) for secret in s3.secrets)


@pytest.mark.timeout(60)
def test_an_unreachable_s3_endpoint_fails_within_the_retry_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from s3_fixtures import SECRETS, point_aws_env_at

    closed = free_port()  # nothing listens there
    point_aws_env_at(monkeypatch, f"http://127.0.0.1:{closed}", tmp_path)
    t0 = time.monotonic()
    report, _ = run_checks(tmp_path, checkpoint_url="s3://no-such-host-bucket/run1")
    took = time.monotonic() - t0
    checks = by_name(report)
    reach = checks["checkpoint_reachable"]
    assert [c.name for c in report.failed] == ["checkpoint_reachable"]
    assert took < PROBE_BUDGET_S + 2, took
    assert reach.value.startswith("no answer in ") and "ConnectionRefusedError" in reach.value
    assert f"127.0.0.1:{closed}" in reach.detail and "AWS_ENDPOINT_URL" in reach.detail
    assert "6 attempt(s)" in reach.detail  # retried under the policy, not given up at once
    assert checks["checkpoint_space"].skipped
    assert checks["checkpoint_space"].value == "not checked: the location did not answer"
    assert not any(secret in json.dumps(report.to_json()) for secret in SECRETS)


# ------------------------------------------------------------------------------ the command
@pytest.mark.timeout(30)
def test_the_users_command_passes_and_fails_with_its_exit_code(tmp_path: Path) -> None:
    ok, _ = run_checks(tmp_path, user_cmd=("sh", "-c", "echo all good"))
    assert ok.ok and by_name(ok)["user_command"].value == "exit 0: all good"

    bad, _ = run_checks(tmp_path, user_cmd=("false",), user_timeout_s=5)
    cmd = by_name(bad)["user_command"]
    assert not bad.ok and (cmd.value, cmd.threshold) == ("exit 1", "exit 0 within 5 s")
    assert cmd.detail.startswith("`false` ended with exit 1 without output")

    sad, events = run_checks(
        tmp_path, user_cmd=("sh", "-c", "echo checking; echo disk is sad >&2; exit 3")
    )
    cmd = by_name(sad)["user_command"]
    assert cmd.value == "exit 3: disk is sad"
    assert sad.summary().startswith("user_command: exit 3: disk is sad (needs exit 0 within 10 s)")
    assert events[-1]["failed"] == ["user_command"]

    crashed, _ = run_checks(tmp_path, user_cmd=("sh", "-c", "echo dying >&2; kill -SEGV $$"))
    assert by_name(crashed)["user_command"].value == "signal SIGSEGV: dying"

    missing, _ = run_checks(tmp_path, user_cmd=(str(tmp_path / "no-such-check"),))
    assert by_name(missing)["user_command"].value.startswith("cannot start: ")


@pytest.mark.timeout(30)
def test_a_hanging_command_is_killed_with_its_children_at_the_timeout(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = f"echo $$ > {pids}; sleep 30 & echo $! >> {pids}; echo waiting >&2; wait"
    t0 = time.monotonic()
    report, _ = run_checks(tmp_path, user_cmd=("sh", "-c", script), user_timeout_s=1)
    took = time.monotonic() - t0
    cmd = by_name(report)["user_command"]
    assert took < 3, took
    assert not report.ok and cmd.value == "timed out after 1 s: waiting"
    assert "raise --health-check-timeout" in cmd.detail
    shell, sleeper = (int(p) for p in pids.read_text().split())
    assert not alive(shell) and not alive(sleeper)


# ------------------------------------------------------------------------------ host
@pytest.mark.timeout(30)
def test_shm_must_hold_the_floor_for_every_local_rank(tmp_path: Path) -> None:
    if not os.path.isdir(SHM_PATH):
        pytest.skip(f"no {SHM_PATH} here")
    free = shutil.disk_usage(SHM_PATH).free
    fits = max(1, free // SHM_PER_RANK // 2)
    report, _ = run_checks(tmp_path, nproc_per_node=fits)
    assert by_name(report)["shm"].ok and report.ok
    too_many = free // SHM_PER_RANK + 1
    report, _ = run_checks(tmp_path, nproc_per_node=too_many)
    shm = by_name(report)["shm"]
    assert [c.name for c in report.failed] == ["shm"]
    assert shm.threshold.startswith(
        f"≥ {fmt_bytes(too_many * SHM_PER_RANK)} free: {too_many} local rank(s) x 256.0 MiB"
    )
    assert shm.value.endswith(f"free of {fmt_bytes(shutil.disk_usage(SHM_PATH).total)}")
    assert "--shm-size" in shm.detail


@pytest.mark.timeout(30)
def test_host_memory_is_sized_from_the_newest_attempts_snapshot_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RESILIENT_SNAPSHOT", raising=False)
    run = tmp_path / "run"
    report, _ = run_checks(tmp_path, nproc_per_node=2)
    mem = by_name(report)["host_memory"]
    assert mem.skipped and "no snapshot.memory event" in mem.value

    avail = psutil.virtual_memory().available
    huge = int(avail)  # two copies of this per rank cannot fit
    snapshot_event(run, rank=0, restart=0, per_copy=huge)  # an older attempt, bigger
    time.sleep(0.01)
    snapshot_event(run, rank=0, restart=1, per_copy=100 << 20)
    snapshot_event(run, rank=1, restart=1, per_copy=150 << 20)
    report, _ = run_checks(tmp_path, nproc_per_node=2)
    mem = by_name(report)["host_memory"]
    assert mem.ok and not mem.skipped
    assert mem.threshold == (
        "≥ 1.2 GiB available: 2 local rank(s) x 300.0 MiB of snapshot buffers (rank 1 logged "
        "it in restart 1) = 600.0 MiB, at most memory_fraction 0.5 of it"
    )
    assert mem.value.endswith(" available")

    time.sleep(0.01)
    snapshot_event(run, rank=0, restart=2, per_copy=huge)
    report, _ = run_checks(tmp_path, nproc_per_node=2)
    mem = by_name(report)["host_memory"]
    assert [c.name for c in report.failed] == ["host_memory"]
    assert f"x {fmt_bytes(2 * huge)} of snapshot buffers (rank 0 logged it in restart 2)" in (
        mem.threshold
    )
    assert "turn snapshots off" in mem.detail


@pytest.mark.timeout(30)
def test_host_memory_reads_the_head_and_the_tail_of_a_long_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RESILIENT_SNAPSHOT", raising=False)
    run = tmp_path / "run"
    snapshot_event(run, rank=0, restart=0, per_copy=100 << 20)  # the first attempt's track()
    line = json.dumps({"event": "train.progress", "first": 1, "last": 2, "rank": 0}) + "\n"
    filler = line * ((LOG_HEAD + LOG_TAIL) // len(line) + 1)
    with (run / "logs" / "rank0.jsonl").open("a") as f:
        f.write(filler)
    report, _ = run_checks(tmp_path)
    assert "(rank 0 logged it in restart 0)" in by_name(report)["host_memory"].threshold

    time.sleep(0.01)
    snapshot_event(run, rank=0, restart=1, per_copy=120 << 20)  # now in the tail
    report, _ = run_checks(tmp_path)
    mem = by_name(report)["host_memory"]
    assert "x 240.0 MiB of snapshot buffers (rank 0 logged it in restart 1)" in mem.threshold

    with (run / "logs" / "rank0.jsonl").open("a") as f:
        f.write(filler)  # restart 1's event is now beyond both windows: restart 0's is used
    report, _ = run_checks(tmp_path)
    assert "x 200.0 MiB of snapshot buffers (rank 0 logged it in restart 0)" in (
        by_name(report)["host_memory"].threshold
    )


@pytest.mark.timeout(60)
def test_host_memory_before_any_snapshot_comes_from_the_environment_and_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RESILIENT_SNAPSHOT", '{"enabled": true, "memory_fraction": 0.25}')
    root = tmp_path / "ckpt"
    report, _ = run_checks(tmp_path, checkpoint_url=str(root), nproc_per_node=4)
    mem = by_name(report)["host_memory"]
    assert mem.skipped and "of unknown size" in mem.value

    total = save_checkpoint(str(root), step=3)
    report, _ = run_checks(tmp_path, checkpoint_url=str(root), nproc_per_node=4)
    mem = by_name(report)["host_memory"]
    assert mem.ok and not mem.skipped
    per_rank = 2 * math.ceil(total / 1)  # the checkpoint was written by one rank
    assert mem.threshold == (
        f"≥ {fmt_bytes(4 * per_rank / 0.25)} available: 4 local rank(s) x "
        f"{fmt_bytes(per_rank)} of snapshot buffers (2 copies of checkpoint step 3's "
        f"{fmt_bytes(total)} over the 1 rank(s) that wrote it, a floor) = "
        f"{fmt_bytes(4 * per_rank)}, at most memory_fraction 0.25 of it"
    )

    monkeypatch.setenv("RESILIENT_SNAPSHOT", "off")
    report, _ = run_checks(tmp_path, checkpoint_url=str(root), nproc_per_node=4)
    assert by_name(report)["host_memory"].skipped


# ------------------------------------------------------------------------------ GPUs
FAKE_PYNVML = textwrap.dedent(
    '''
    """A stand-in for nvidia-ml-py's pynvml: devices described by $FAKE_NVML (JSON)."""
    import json
    import os

    _CFG = json.loads(os.environ["FAKE_NVML"])
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_ERROR_FUNCTION_NOT_FOUND = 13
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_VOLATILE_ECC = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_FEATURE_DISABLED = 0
    NVML_FEATURE_ENABLED = 1


    class NVMLError(Exception):
        def __init__(self, value):
            self.value = value

        def __str__(self):
            return f"fake NVML error {self.value}"


    class NVMLError_NotSupported(NVMLError):
        pass


    def _note(what):
        with open(_CFG["calls"], "a") as f:
            f.write(what + "\\n")


    def _answer(value):
        if value == "unsupported":
            raise NVMLError_NotSupported(NVML_ERROR_NOT_SUPPORTED)
        if value == "lost":
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return value


    def nvmlInit():
        _note("init")
        if _CFG.get("init_error"):
            raise NVMLError(_CFG["init_error"])


    def nvmlShutdown():
        _note("shutdown")


    def nvmlDeviceGetCount():
        return len(_CFG["devices"])


    def nvmlDeviceGetHandleByIndex(index):
        _note(f"handle {index}")
        _answer(_CFG["devices"][index].get("handle", 0))
        return index


    def nvmlDeviceGetTotalEccErrors(handle, error_type, counter_type):
        assert (error_type, counter_type) == (1, 0), (error_type, counter_type)
        return _answer(_CFG["devices"][handle].get("ecc", 0))


    def nvmlDeviceGetRetiredPagesPendingStatus(handle):
        return _answer(_CFG["devices"][handle].get("pending", NVML_FEATURE_DISABLED))


    def nvmlDeviceGetRemappedRows(handle):
        return _answer(_CFG["devices"][handle].get("rows", [0, 0, 0, 0]))
    '''
)

CHECK_GPU = (
    "import json, sys\n"
    "from resilient.health import HealthInputs, check_node\n"
    "from resilient.log import EventLog\n"
    "r = check_node(HealthInputs(run_dir=sys.argv[1], checkpoint_url=None, nproc_per_node=1),"
    " EventLog(console_level='CRITICAL'))\n"
    "print(json.dumps([c for c in r.to_json()['checks'] if c['name'] == 'gpu'][0]))\n"
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("devices", "visible", "ok", "value"),
    [
        (
            [{"ecc": 0}, {"ecc": 3}],
            None,
            False,
            "device 1: 3 uncorrectable ECC error(s) since the driver loaded",
        ),
        ([{"ecc": 0}, {"ecc": 3}], "0", True, "1 device(s) healthy: 0 (CUDA_VISIBLE_DEVICES=0)"),
        (
            [{"pending": 1, "rows": "unsupported"}, {"ecc": "unsupported", "rows": [0, 0, 1, 0]}],
            "1,0",
            False,
            "device 1: memory rows pending remapping; device 0: memory pages pending retirement",
        ),
        ([{}, {"handle": "lost"}], None, False, "device 1: does not answer (fake NVML error 15)"),
        ([{}], "0,1", False, "device 1 (CUDA_VISIBLE_DEVICES=0,1) is missing: NVML sees 1"),
        ([{}, {}], "GPU-1234", True, "2 device(s) healthy: 0, 1 (all devices"),
        ([{}, {}], "", None, "no GPU visible (CUDA_VISIBLE_DEVICES=)"),
    ],
    ids=["ecc", "visible-subset", "pending", "lost", "missing", "uuid", "none-visible"],
)
def test_gpus_through_a_stand_in_nvml(
    tmp_path: Path, devices: list[dict[str, Any]], visible: str | None, ok: bool | None, value: str
) -> None:
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "pynvml.py").write_text(FAKE_PYNVML)
    calls = tmp_path / "calls"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(fake), str(REPO_ROOT)])
    env["FAKE_NVML"] = json.dumps({"devices": devices, "calls": str(calls)})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    out = subprocess.run(
        [sys.executable, "-c", CHECK_GPU, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=50,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    gpu = json.loads(out.stdout.strip().splitlines()[-1])
    assert gpu["ok"] is (ok is not False) and gpu["skipped"] is (ok is None)
    assert gpu["value"].startswith(value), gpu["value"]
    if ok is False:
        assert "reset" in gpu["detail"]
    said = calls.read_text().split("\n")
    assert said[0] == "init" and said[-2] == "shutdown"  # always shut down again


@pytest.mark.timeout(60)
def test_nvml_that_cannot_start_for_want_of_a_driver_is_skipped_else_fails(
    tmp_path: Path,
) -> None:
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "pynvml.py").write_text(FAKE_PYNVML)
    results = {}
    for code in (9, 18):  # driver not loaded; library and driver versions differ
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake), str(REPO_ROOT)]))
        env["FAKE_NVML"] = json.dumps(
            {"devices": [], "calls": str(tmp_path / "calls"), "init_error": code}
        )
        out = subprocess.run(
            [sys.executable, "-c", CHECK_GPU, str(tmp_path / "run")],
            capture_output=True,
            text=True,
            timeout=50,
            env=env,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        results[code] = json.loads(out.stdout.strip().splitlines()[-1])
    assert results[9]["ok"] and results[9]["skipped"]
    assert results[9]["value"] == "no NVIDIA driver here (NVML: fake NVML error 9)"
    assert not results[18]["ok"] and results[18]["value"] == (
        "NVML does not start: fake NVML error 18"
    )
    assert "reboot" in results[18]["detail"]


@pytest.mark.timeout(30)
def test_the_real_nvml_on_a_machine_without_a_driver_is_skipped(tmp_path: Path) -> None:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    report, _ = run_checks(tmp_path)
    gpu = by_name(report)["gpu"]
    assert gpu.ok and gpu.skipped and gpu.value.startswith("no NVIDIA driver here (NVML: ")


@pytest.mark.timeout(30)
def test_shm_is_not_needed_when_the_newest_attempts_loaders_run_no_workers(tmp_path: Path) -> None:
    from resilient.health.host import check_shm

    logs = tmp_path / "logs"
    logs.mkdir()

    def loader(restart: int, workers: int) -> str:
        return json.dumps(
            {"event": "data.loader", "num_workers": workers, "run_id": "r", "restart": restart,
             "rank": 0, "ts": f"2026-11-27T00:00:0{restart}Z"}
        )  # fmt: skip

    (logs / "rank0.jsonl").write_text(loader(0, 4) + "\n" + loader(1, 0) + "\n")
    result = check_shm(8, str(tmp_path))
    assert result.ok and result.skipped and "num_workers 0" in result.value
    (logs / "rank0.jsonl").write_text(loader(0, 0) + "\n" + loader(1, 2) + "\n")
    result = check_shm(8, str(tmp_path))
    assert not result.skipped and "8 local rank(s)" in result.threshold
    assert not check_shm(8, str(tmp_path / "none")).skipped  # nothing told yet: the floor
