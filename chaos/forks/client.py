"""The caller's side: its fork servers, and the Popen that asks them for its child."""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from chaos.forks.wire import (
    LAUNCHERS,
    PR_SET_CHILD_SUBREAPER,
    import_time_env,
    parse_python_argv,
    recv,
)

# not `-m chaos.forks.server`: that module must be one module in the server, not also __main__
_SERVER_MAIN = "import sys; from chaos.forks.server import serve; serve(sys.argv[1])"


def be_subreaper() -> None:
    """Orphans below this process come to it, not to init: a command forked by a server
    below it becomes its child once the middle process exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


class ForkServer:
    """One server, for commands whose import-time environment is `key`; started on first use
    by the process that uses it (its caller)."""

    def __init__(
        self, workdir: Path, key: dict[str, str], socket_path: str = "", pid: int = 0
    ) -> None:
        self.workdir = workdir
        self.key = key
        self.proc: subprocess.Popen[str] | None = None
        self.socket = socket_path
        self.nursery = pid  # a server forked off this process (_open_nursery), not started

    def start_server(self) -> None:
        be_subreaper()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.socket = str(self.workdir / f"forks-{os.getpid()}-{id(self)}.sock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)
        env = {k: v for k, v in os.environ.items() if k not in import_time_env(os.environ)}
        env.update(self.key)
        repo = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
        err = self.workdir / f"{Path(self.socket).stem}.stderr"
        with err.open("w") as err_file:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", "-c", _SERVER_MAIN, self.socket],
                env=env,
                cwd=repo,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err_file,
                start_new_session=True,
                text=True,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        printed = err.read_text()
        if line != "ready" or printed:
            # a warning its imports print would reach a fresh command's stderr, not a fork's
            self.close()
            raise RuntimeError(f"the server said {line!r}, and on stderr: {printed[-2000:]!r}")

    def running(self) -> bool:
        if self.nursery:
            return os.waitpid(self.nursery, os.WNOHANG) == (0, 0)
        return self.proc is not None and self.proc.poll() is None

    def start(self, job: dict[str, Any], fds: list[int]) -> int:
        """Fork the command; its pid (by then a child of ours)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.socket)
            data = json.dumps(job).encode()
            socket.send_fds(conn, [struct.pack("!I", len(data)) + data], fds)
            answer, _ = recv(conn)
        return int(answer["pid"])

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket)
        self.proc = None


class ForkServers:
    """The caller's servers, one per import-time environment its commands ask for (with and
    without OMP_NUM_THREADS=1, typically); a server that fails to start is not tried again
    and its commands start fresh."""

    def __init__(self, workdir: Path, *, start_more: bool = True) -> None:
        self.workdir = workdir
        self.start_more = start_more  # False in a launcher: only its nursery, else fresh
        self.owner = os.getpid()
        self.servers: dict[frozenset[tuple[str, str]], ForkServer | None] = {}
        self.lock = threading.Lock()

    def for_env(self, env: dict[str, str]) -> ForkServer | None:
        if os.getpid() != self.owner:  # a fork of the caller: its servers are not its own
            return None
        key = import_time_env(env)
        slot = frozenset(key.items())
        with self.lock:
            if slot not in self.servers:
                if not self.start_more:
                    return None
                self.servers[slot] = ForkServer(self.workdir, key)
            server = self.servers[slot]
            if server is None or server.running():
                return server
            if not server.nursery:  # a nursery is not restarted: its launcher has threads now
                try:
                    server.start_server()
                    return server
                except Exception as e:
                    print(f"chaos.forks: not used ({type(e).__name__}: {e})", file=sys.stderr)
            self.servers[slot] = None
            return None

    def adopt(self, key: dict[str, str], server: ForkServer) -> None:
        self.servers[frozenset(key.items())] = server

    def close(self) -> None:
        if os.getpid() == self.owner:
            for server in self.servers.values():
                if server is not None:
                    server.close()
        self.servers.clear()


_SERVERS: ForkServers | None = None
_EXEC_PARAMS = list(inspect.signature(subprocess.Popen._execute_child).parameters)[1:]  # type: ignore[attr-defined]


def set_servers(servers: ForkServers | None) -> None:
    global _SERVERS
    _SERVERS = servers


class ForkedPopen(subprocess.Popen):
    """subprocess.Popen whose child comes from the fork server when it can be (see the
    module's docstring); every other method is Popen's own."""

    def _execute_child(self, *args: Any) -> None:
        a = dict(zip(_EXEC_PARAMS, args, strict=True))
        argv = list(a["args"]) if isinstance(a["args"], (list, tuple)) else None
        parsed = parse_python_argv([os.fspath(x) for x in argv]) if argv else None
        env = dict(a["env"]) if a["env"] is not None else dict(os.environ)
        env.update(parsed.pop("env", {}) if parsed else {})  # `env K=V` in the command line
        plain = (
            parsed is not None
            and a["executable"] is None
            and a["preexec_fn"] is None
            and not a["pass_fds"]
            and not a["shell"]
            and a["close_fds"]
            and a["gid"] is None
            and not a["gids"]
            and a["uid"] is None
            and a["umask"] < 0
            and a.get("process_group", -1) in (-1, None)
        )
        server = _SERVERS.for_env(env) if plain and _SERVERS is not None else None
        if server is None:
            super()._execute_child(*args)  # type: ignore[misc]
            return
        assert parsed is not None
        fds = [
            a["p2cread"] if a["p2cread"] != -1 else 0,
            a["c2pwrite"] if a["c2pwrite"] != -1 else 1,
            a["errwrite"] if a["errwrite"] != -1 else 2,
        ]
        job = {
            **parsed,
            "env": env,
            "cwd": os.path.abspath(os.fspath(a["cwd"]) if a["cwd"] is not None else "."),
            "new_session": bool(a["start_new_session"]),
            "parent": os.getpid(),
        }
        if parsed.get("module") in LAUNCHERS:
            job["nursery"] = str(_SERVERS.workdir) if _SERVERS is not None else ""
        try:
            self.pid = server.start(job, fds)
            self._child_created = True
        finally:
            self._close_pipe_fds(  # type: ignore[attr-defined]
                a["p2cread"],
                a["p2cwrite"],
                a["c2pread"],
                a["c2pwrite"],
                a["errread"],
                a["errwrite"],
            )
