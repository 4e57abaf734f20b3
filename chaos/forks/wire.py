"""What the caller and the fork server share: the message format, which environment
variables a forked command must share with its server, and which command lines it can run."""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from collections.abc import Mapping
from typing import Any

# read when the server imports its modules (or when an interpreter starts): a command whose
# value differs from its server's gets a server of its own (or, in a launcher, a fresh start)
IMPORT_TIME_ENV = (
    "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH_LOGS", "TORCHDYNAMO_", "TORCHINDUCTOR_",
    "PYTORCH_", "LD_", "HF_", "TRANSFORMERS_", "PL_", "LIGHTNING_",
)  # fmt: skip
PRELOAD_ENV = "CHAOS_FORK_PRELOAD"
"""Comma-separated modules a server imports besides its own list (server._PRELOAD): a test
module of framework runs sets it, so its ranks fork with transformers or lightning loaded
(about 3 s of CPU each otherwise). An import-time variable: those commands get a server of
their own."""
IMPORT_TIME_EXACT = {"PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", PRELOAD_ENV}
PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1
# launchers whose workers come from a nursery forked off them (server._open_nursery)
LAUNCHERS = {"resilient.cli", "torch.distributed.run", "chaos.quiet_resize"}


def import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) or k in IMPORT_TIME_EXACT}


def parse_python_argv(argv: list[str]) -> dict[str, Any] | None:
    """`python [-u] -m MODULE ARGS` or `python [-u] SCRIPT ARGS` as {"module"|"script", "args",
    "unbuffered"}, behind an optional `ip netns exec NS [env K=V ...]` (chaos/netns.py's hosts:
    "netns", "env"); None for any other form (it is started fresh)."""
    found: dict[str, Any] = {}
    if argv[:3] == ["ip", "netns", "exec"] and len(argv) > 4:
        found["netns"], argv = argv[3], argv[4:]
        if argv[0] == "env":
            argv = argv[1:]
            while argv and "=" in argv[0] and not argv[0].startswith("-"):
                key, value = argv[0].split("=", 1)
                found.setdefault("env", {})[key] = value
                argv = argv[1:]
    python = _parse_python(argv)
    return None if python is None else {**python, **found}


def _parse_python(argv: list[str]) -> dict[str, Any] | None:
    if not argv or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return None
    rest, unbuffered = argv[1:], False
    while rest and rest[0] == "-u":
        rest, unbuffered = rest[1:], True
    if len(rest) >= 2 and rest[0] == "-m":
        return {"module": rest[1], "args": rest[2:], "unbuffered": unbuffered}
    if rest and not rest[0].startswith("-") and rest[0].endswith(".py"):
        return {"script": rest[0], "args": rest[1:], "unbuffered": unbuffered}
    return None


def send(conn: socket.socket, obj: object) -> None:
    data = json.dumps(obj).encode()
    conn.sendall(struct.pack("!I", len(data)) + data)


def recv(conn: socket.socket, fds: int = 0) -> tuple[Any, list[int]]:
    head, got, _, _ = socket.recv_fds(conn, 4, fds) if fds else (conn.recv(4), [], 0, None)
    if len(head) < 4:
        raise EOFError
    (size,) = struct.unpack("!I", head)
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return json.loads(data), list(got)
