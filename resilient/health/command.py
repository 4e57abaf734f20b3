"""The user's own node check (--health-check CMD): exit 0 within the timeout, or the node is
unhealthy.

The command runs in a session (and process group) of its own, with no stdin. When it runs
past its timeout, it is killed with its whole tree (resilient.proctree.kill_tree: its group,
and any descendant that left the group), so nothing it started outlives the check.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import subprocess
import time

from resilient.health.report import CheckResult, failed_check, ok_check, skipped_check
from resilient.proctree import kill_tree

__all__ = ["KILL_WAIT_S", "check_command"]

NAME = "user_command"
KILL_WAIT_S = 2.0
"""After the timeout: how long the killed tree may take to go, and its pipes to close."""


def check_command(cmd: tuple[str, ...], timeout_s: float) -> CheckResult:
    t0 = time.perf_counter()
    if not cmd:
        return skipped_check(NAME, t0, "no --health-check command given")
    shown = shlex.join(cmd)
    threshold = f"exit 0 within {timeout_s:g} s"
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as e:
        fix = f"make `{shown}` runnable on this node (installed, on PATH, executable)"
        return failed_check(NAME, t0, f"cannot start: {e}", threshold, fix)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid, groups=[proc.pid], wait_s=KILL_WAIT_S)
        out, err = _leftovers(proc)
        said = _last_line(err, out)
        value = f"timed out after {timeout_s:g} s" + (f": {said}" if said else "")
        fix = (
            f"`{shown}` did not finish within {timeout_s:g} s and was killed: find what it waits "
            "for on this node, or raise --health-check-timeout"
        )
        return failed_check(NAME, t0, value, threshold, fix)
    said = _last_line(err, out)
    if proc.returncode != 0:
        how = _exit(proc.returncode)
        value = how + (f": {said}" if said else "")
        fix = f"`{shown}` ended with {how}" + (
            f", its last line: {said}" if said else " without output"
        )
        return failed_check(NAME, t0, value, threshold, fix + "; fix what it checks on this node")
    return ok_check(NAME, t0, "exit 0" + (f": {said}" if said else ""), threshold)


def _exit(code: int) -> str:
    """ "exit 3", or "signal SIGSEGV" for a command killed by one."""
    if code >= 0:
        return f"exit {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def _leftovers(proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    """What a killed command wrote before it died; never waits past KILL_WAIT_S."""
    try:
        return proc.communicate(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:  # something outside its tree holds the pipes open
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=KILL_WAIT_S)
        return b"", b""


def _last_line(*streams: bytes | None) -> str:
    """The last non-blank line of the first stream that has one, shortened."""
    for data in streams:
        lines = [ln.strip() for ln in (data or b"").decode(errors="replace").splitlines()]
        lines = [ln for ln in lines if ln]
        if lines:
            return lines[-1][:300]
    return ""
