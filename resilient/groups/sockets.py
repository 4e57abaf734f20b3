"""This process's TCP connections to other workers, and cutting them from this side.

A survivor of a lost rank leaves its generation in place: it re-runs the script in the same
process, and its old process groups' connections stay open (docs/hot-recovery.md: torch's
DTensor caches keep a mesh, and with it its groups, alive; gloo cannot abort a collective).
In a flat world every survivor meets the lost rank in the step's collective and fails at
once. On a mesh it need not: under HSDP a rank can wait in its replicate all-reduce on a
survivor that met the loss in its own shard group and already left, and that wait never
ends. The survivor that leaves therefore publishes the local endpoints of its connections
(`endpoints`), and a rank still waiting shuts down its own sockets whose remote end is one
of them (`sever`): its collective then fails as it would have on the lost rank, and it
takes the hot path too.

The endpoints identify the connections exactly: a socket in this process whose remote end is
a socket of the departed worker's process connects the two workers, and every such
connection belongs to the generation that worker left (the launcher's store, the one
connection a worker keeps across generations, lives in the agent, never in a worker).
"""

from __future__ import annotations

import contextlib
import socket

import psutil

__all__ = ["endpoints", "sever"]

Endpoint = tuple[str, int]


def endpoints() -> list[Endpoint]:
    """The local (address, port) of every established TCP connection of this process."""
    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    return sorted(
        {(str(c.laddr.ip), int(c.laddr.port)) for c in conns if c.status == "ESTABLISHED"}
    )


def sever(remote: set[Endpoint]) -> int:
    """Shut down (both directions) this process's connections whose remote end is in
    `remote`; returns how many. The file descriptors stay open: their owner (gloo's loop)
    sees the connection end and fails what waits on it, and closes them itself."""
    if not remote:
        return 0
    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return 0
    cut = 0
    for c in conns:
        if not c.raddr or c.fd < 0 or (str(c.raddr.ip), int(c.raddr.port)) not in remote:
            continue
        with contextlib.suppress(OSError):
            # a duplicate of the descriptor: shutdown acts on the connection, close on the dup
            dup = socket.fromfd(c.fd, c.family, c.type)
            try:
                dup.shutdown(socket.SHUT_RDWR)
                cut += 1
            finally:
                dup.close()
    return cut
