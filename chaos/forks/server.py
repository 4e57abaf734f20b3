"""The fork server: imports what the commands import, then forks each command asked for
(chaos/forks/__init__.py says what the command sees)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any

from chaos.forks.client import ForkedPopen, ForkServer, ForkServers, be_subreaper, set_servers
from chaos.forks.wire import PR_SET_PDEATHSIG, PRELOAD_ENV, import_time_env, recv, send

_CLONE_NEWNET = 0x40000000
# what a rank, a supervisor and the chaos wrapper import: loaded by the server, once
# (not the modules the commands run with -m: runpy runs those afresh as __main__)
_PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "torchdata.stateful_dataloader",
    "resilient.worker",
    "resilient.supervisor.launcher",
    "chaos.faults",
)


def _python_path(job: dict[str, Any], base: list[str]) -> list[str]:
    """sys.path as `python` would build it for this command: the script's folder (or the
    working directory for -m), PYTHONPATH, then the interpreter's own entries."""
    first = str(Path(job["cwd"], job["script"]).resolve().parent) if "script" in job else job["cwd"]
    extra = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    return [first, *extra, *base]


def _become(job: dict[str, Any], fds: list[int], base_path: list[str], parent: int) -> None:
    """In the grandchild: wait to be the caller's child, take its stdio and environment, run
    the command as `python` would, and exit as the interpreter would. Never returns."""
    code = 1
    try:
        while os.getppid() != parent:  # the middle process exits at once
            os.sched_yield()
        if job.get("netns"):  # what `ip netns exec NS` does for the network
            _enter_netns(job["netns"])
        if job["new_session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        os.environ.clear()
        os.environ.update(job["env"])
        os.chdir(job["cwd"])
        sys.path[:] = _python_path(job, base_path)
        if job.get("nursery"):
            _open_nursery(job["nursery"], base_path)
        if job["unbuffered"] or job["env"].get("PYTHONUNBUFFERED"):
            for stream in (sys.stdout, sys.stderr):
                stream.reconfigure(write_through=True)  # type: ignore[union-attr]
        # runpy warns that a module run with -m was imported already (torch.distributed.run
        # is, by the supervisor's modules); it runs a fresh copy as __main__ all the same
        warnings.filterwarnings("ignore", "'.*' found in sys.modules after import", RuntimeWarning)
        try:
            if "module" in job:
                sys.argv = [job["module"], *job["args"]]
                runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [job["script"], *job["args"]]
                runpy.run_path(job["script"], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except KeyboardInterrupt:
            traceback.print_exc()
            _flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)  # as the interpreter dies of an unhandled ^C
        except BaseException:
            sys.excepthook(*sys.exc_info())  # the command's own hook, as the interpreter calls it
            code = 1
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
    finally:
        _flush()
        os._exit(code)


def _enter_netns(name: str) -> None:
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)


def _exit_code(code: object) -> int:
    """What the interpreter makes of SystemExit(code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def serve(path: str) -> None:
    """The server: preload, then one command per connection, until its caller exits."""
    parent = os.getppid()
    extra = [m for m in os.environ.get(PRELOAD_ENV, "").split(",") if m]
    for name in (*_PRELOAD, *extra):
        __import__(name)
    if threading.active_count() != 1:
        raise SystemExit(f"fork server: threads after the imports: {threading.enumerate()}")
    base_path = sys.path[1:]
    for p in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if p in base_path:
            base_path.remove(p)
    listener = _listen(path)
    print("ready", flush=True)
    _serve(listener, base_path, parent)


def _listen(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    return listener


def _serve(listener: socket.socket, base_path: list[str], parent: int) -> None:
    """Fork each command asked for, until `parent` (the caller) is gone."""
    while os.getppid() == parent:
        if not select.select([listener], [], [], 1.0)[0]:
            continue
        conn, _ = listener.accept()
        with conn:
            try:
                job, fds = recv(conn, 3)
            except EOFError:
                continue
            read_end, write_end = os.pipe()
            middle = os.fork()
            if middle == 0:
                listener.close()
                os.close(read_end)
                child = os.fork()
                if child == 0:
                    os.close(write_end)
                    conn.close()
                    _become(job, fds, base_path, job["parent"])
                os.write(write_end, struct.pack("!i", child))
                os._exit(0)
            os.close(write_end)
            (pid,) = struct.unpack("!i", os.read(read_end, 4))
            os.close(read_end)
            os.waitpid(middle, 0)  # once reaped, the command is the caller's child
            for fd in fds:
                os.close(fd)
            send(conn, {"pid": pid})


def _open_nursery(workdir: str, base_path: list[str]) -> None:
    """In a launcher (`resilient run`, torchrun) about to start: fork, while it is still one
    thread, a server of its own for its workers (it has every module they import), and have
    torch elastic start them through it. The nursery dies with the launcher."""
    key = import_time_env(dict(os.environ))
    path = os.path.join(workdir, f"nursery-{os.getpid()}.sock")
    listener = _listen(path)
    launcher = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != launcher:
                os._exit(0)
            os.setpgid(0, 0)  # not one of the launcher's group: the harness checks that group
            null = os.open(os.devnull, os.O_RDWR)
            for target in (0, 1, 2):  # never hold the launcher's output pipes open
                os.dup2(null, target)
            os.closerange(3, listener.fileno())
            os.closerange(listener.fileno() + 1, os.sysconf("SC_OPEN_MAX"))
            _serve(listener, base_path, launcher)
        finally:
            os._exit(0)
    listener.close()
    be_subreaper()
    servers = ForkServers(Path(workdir), start_more=False)
    servers.adopt(key, ForkServer(Path(workdir), key, socket_path=path, pid=pid))
    set_servers(servers)
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler,
    )

    # torch's worker handler imported the name; the agent's spare (resilient/supervisor/
    # spare.py) and anything else the launcher starts look it up in subprocess
    subprocess_handler.Popen = ForkedPopen  # type: ignore[misc]
    subprocess.Popen = ForkedPopen  # type: ignore[misc]
