"""A node that fails its health checks leaves the job, and the job goes on without it: two real
hosts (network namespaces), one `resilient run` each with --nnodes 1:2.

- mid-run (CI): host B's own check (`--health-check`) starts failing; B's worker is killed;
  at the restart B's agent leaves with NODE_EXCLUDED and A finishes the run alone;
- at the start (make soak): B's /dev/shm is a 1 MiB tmpfs, or its checkpoint directory a full
  one (private mounts in B's own mount namespace): B never joins, A runs the job alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import SUPERVISED_WORKER, kill_tree, records, run_cmd, run_events, spawn, wait_for

from chaos.netns import Hosts, netns_unavailable
from resilient.exitcodes import ExitCode

STEPS = 24


def _agent(
    hosts: Hosts, i: int, tmp: Path, ckpt: Path, *extra: str, wrap: list[str] | None = None
) -> subprocess.Popen[bytes]:
    name = "AB"[i]
    cmd = [
        *hosts.exec_prefix(i),
        *(wrap or []),
        *run_cmd(
            "--nnodes=1:2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={hosts.addr[0]}:29400",
            "--rdzv-id=exclusion",
            f"--rdzv-conf=is_host={int(i == 0)},last_call_timeout=1,join_timeout=120",
            f"--local-addr={hosts.addr[i]}",
            f"--run-dir={tmp / ('run' + name)}",
            f"--checkpoint-url={ckpt}",
            "--restart-backoff=0.2",
            "--restart-jitter=0",
            "--status=off",
            *extra,
            str(SUPERVISED_WORKER),
            f"--record={tmp / 'rec'}",
            f"--steps={STEPS}",
            "--save-every=4",
            "--sleep=0.3",
            '--watchdog={"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3, '
            '"timeout_s": 30, "startup_timeout_s": 60}',
        ),
    ]  # fmt: skip
    with (tmp / f"{name}.log").open("ab") as out:
        return spawn(cmd, stdout=out, stderr=subprocess.STDOUT)


def _log(tmp: Path, name: str) -> str:
    return (tmp / f"{name}.log").read_text(errors="replace")[-4000:]


def _stop(procs: list[subprocess.Popen[bytes]], hosts: Hosts) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
    hosts.down()
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
        kill_tree(p.pid, groups=(p.pid,))


def _steps_at(tmp: Path, world: int) -> list[int]:
    return [r["step"] for r in records(tmp / "rec") if r["world"] == world and r["rank"] == 0]


def _report(run_dir: Path) -> dict:
    (path,) = run_dir.glob("supervisor_report*.json")
    return json.loads(path.read_text())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_node_whose_health_check_starts_failing_leaves_at_the_restart(tmp_path: Path) -> None:
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    ckpt, flag = tmp_path / "ckpt", tmp_path / "B-is-broken"
    hosts = Hosts()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        hosts.up()
        b = _agent(hosts, 1, tmp_path, ckpt, f"--health-check=test ! -e {flag}")
        procs.append(b)
        wait_for(
            lambda: run_events(tmp_path / "runB", "supervisor.start"), timeout=60, what="B's agent"
        )
        a = _agent(hosts, 0, tmp_path, ckpt)
        procs.append(a)
        wait_for(lambda: len(_steps_at(tmp_path, 2)) >= 6, timeout=120, what="steps on two hosts")
        flag.touch()  # from now on B's own check fails
        (b_worker,) = {e["pid"] for e in run_events(tmp_path / "runB", "runtime.init")}
        os.kill(b_worker, signal.SIGKILL)  # a failure: both agents restart their workers
        assert b.wait(timeout=120) == ExitCode.NODE_EXCLUDED, _log(tmp_path, "B")
        assert a.wait(timeout=180) == 0, _log(tmp_path, "A")
    finally:
        _stop(procs, hosts)
    alone = _steps_at(tmp_path, 1)
    assert alone and max(alone) == STEPS - 1  # A finished the run by itself
    (left,) = run_events(tmp_path / "runB", "node.excluded")
    assert left["reason"] == "health" and "user_command" in left["detail"]
    checks = run_events(tmp_path / "runB", "health.check")
    user = [c for c in checks if c["name"] == "user_command"]
    assert [c["ok"] for c in user] == [True, False]  # passed at the start, failed at the restart
    rep = _report(tmp_path / "runB")
    assert rep["exit_code"] == ExitCode.NODE_EXCLUDED and rep["outcome"] == "node excluded"
    failed = [c for c in rep["health"][-1]["checks"] if not c["ok"]]
    assert [c["name"] for c in failed] == ["user_command"] and "exit 1" in failed[0]["value"]
    # A's own checks passed every round, and A never counted B's leaving as a crash loop
    assert all(c["ok"] for c in run_events(tmp_path / "runA", "health.done"))
    assert _report(tmp_path / "runA")["outcome"] == "succeeded"


def _private_mount(target: str, size: str, fill: bool) -> list[str]:
    """A wrapper that gives the agent its own mount namespace with a tmpfs of `size` on
    `target` (full to the last byte with `fill`), then runs the agent."""
    script = f"mount -t tmpfs -o size={size} tmpfs {target}"
    if fill:
        script += f" && (dd if=/dev/zero of={target}/fill bs=64k 2>/dev/null || true)"
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        script + ' && exec "$@"',
        "sh",
    ]


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("broken", ["shm", "checkpoint_space"])
def test_a_node_with_a_small_shm_or_a_full_checkpoint_disk_never_joins(
    tmp_path: Path, broken: str
) -> None:
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    if broken == "shm":
        wrap = _private_mount("/dev/shm", "1m", fill=False)
    else:
        wrap = _private_mount(str(ckpt), "256k", fill=True)
    hosts = Hosts()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        hosts.up()
        a = _agent(hosts, 0, tmp_path, ckpt)
        procs.append(a)
        b = _agent(hosts, 1, tmp_path, ckpt, wrap=wrap)
        procs.append(b)
        assert b.wait(timeout=60) == ExitCode.NODE_EXCLUDED, _log(tmp_path, "B")
        assert a.wait(timeout=180) == 0, _log(tmp_path, "A")
    finally:
        _stop(procs, hosts)
    assert not _steps_at(tmp_path, 2) and max(_steps_at(tmp_path, 1)) == STEPS - 1
    (left,) = run_events(tmp_path / "runB", "node.excluded")
    assert left["reason"] == "health"
    failed = [c for c in _report(tmp_path / "runB")["health"][-1]["checks"] if not c["ok"]]
    assert broken in [c["name"] for c in failed]
