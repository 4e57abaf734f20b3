"""`resilient rendezvous`: the job's rendezvous store, served apart from every training node.

torch elastic's c10d rendezvous keeps its state in a TCPStore. By default the agent of the
node named by --rdzv-endpoint hosts it in-process (torch's c10d backend makes the server
there when the endpoint is this machine), so that node's loss ends the job for every node.
This command serves the same store, torch's public `TCPStore(is_master=True)`, as a small
long-lived process of its own (a login node, the job's head pod); every `resilient run
--rdzv-endpoint HOST:PORT --rdzv-external` then connects to it as a client.

It holds only the rendezvous state and the few keys `resilient run` keeps beside it (which
server this is, which job holds a rendezvous id: resilient/storekeys.py). The store's keys
live in memory: a restart empties it, which the launchers survive (supervisor/rdzv.py,
docs/operating.md#the-rendezvous-store). SIGTERM or SIGINT stops it cleanly (exit 0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from types import FrameType

from resilient import storekeys
from resilient.exitcodes import ExitCode
from resilient.log import EventLog

__all__ = ["DEFAULT_PORT", "main", "serve"]

DEFAULT_PORT = 29400
"""torch's default c10d rendezvous port."""


def serve(port: int, *, host: str, log: EventLog, stop: threading.Event) -> int:
    """Serve the store on `port` (0: any free port) until `stop` is set; returns the exit
    code. `host` is the name the training nodes use to reach it: the server listens on every
    interface of this machine (TCPStore has no bind address), and checks itself through it."""
    from datetime import timedelta

    from torch.distributed import DistError, TCPStore

    try:
        server = TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
    except (DistError, RuntimeError, ValueError) as e:
        log.error("rendezvous.failed", host=host, port=port, error=str(e).splitlines()[0][:300])
        print(
            f"resilient rendezvous: error: cannot serve on port {port}: "
            f"{str(e).splitlines()[0][:300]} (is another store there already?)",
            file=sys.stderr,
        )
        return int(ExitCode.USAGE)
    started = time.time()
    server.set(
        storekeys.SERVER,
        json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}),
    )
    log.info("rendezvous.serving", host=host, port=server.port, endpoint=f"{host}:{server.port}")
    stop.wait()
    log.info("rendezvous.stop", port=server.port, served_s=round(time.time() - started, 3))
    del server  # the server's threads stop with it; clients see the connection close
    return 0


def main(argv: list[str]) -> int:
    """`resilient rendezvous [--host H] [--port P] [--log-file F]`."""
    p = argparse.ArgumentParser(
        prog="resilient rendezvous",
        description="Serve a rendezvous store apart from the training nodes: start it once, "
        "then give every `resilient run` --rdzv-endpoint HOST:PORT --rdzv-external.",
    )
    p.add_argument(
        "--host",
        default=socket.gethostname(),
        help="the name training nodes reach this machine by (default: its hostname); the "
        "store listens on every interface",
    )
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}; 0: any free"
    )
    p.add_argument("--log-file", default=None, help="also write the events as JSON lines here")
    args = p.parse_args(argv)
    if not 0 <= args.port < 65536:
        p.error(f"--port must be 0..65535, got {args.port}")
    log = EventLog(args.log_file, static={"source": "rendezvous", "pid": os.getpid()})
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("rendezvous.signal", signal=signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        return serve(args.port, host=args.host, log=log, stop=stop)
    finally:
        log.close()
