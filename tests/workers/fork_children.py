"""Forks children while the runtime's threads are busy; prints one JSON line of what it saw.

    python tests/workers/fork_children.py RUN_DIR N

A thread writes events without pause (as the watchdog's thread does when it reports), while
the main thread forks N children that each write an event of their own, as a DataLoader
worker whose dataset logs would. Then, with a live Watchdog and an installed
PreemptionWatch, one child checks what it inherited.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from resilient import log
from resilient.groups.groups import DistContext
from resilient.hang.config import WatchdogConfig
from resilient.hang.watchdog import Watchdog
from resilient.preempt.watch import PreemptConfig, PreemptionWatch


def wait_child(pid: int, timeout: float) -> int | None:
    """The child's wait status, or None when it did not end in `timeout` (then killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def main() -> None:
    run_dir, n = sys.argv[1], int(sys.argv[2])
    log.configure(run_dir=run_dir, run_id="fork", rank=0, restart=0, console_level="WARNING")
    logger = log.get_logger()
    stop = threading.Event()

    def chatter() -> None:
        while not stop.is_set():
            logger.info("test.chatter", payload="x" * 200)

    t = threading.Thread(target=chatter, daemon=True)
    t.start()
    hung = 0
    for i in range(n):
        pid = os.fork()
        if pid == 0:
            logger.info("test.child", child=i)
            os._exit(0)
        hung += wait_child(pid, 5.0) is None
    stop.set()
    t.join()

    ctx = DistContext(
        rank=0, world_size=1, local_rank=0, restart=0, run_id="fork", host="h", backend=None
    )
    cfg = WatchdogConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0, timeout_s=1.0)
    wd = Watchdog(cfg, ctx, run_dir)
    wd.start()
    watch = PreemptionWatch(PreemptConfig(), group=None, distributed=False)
    watch.install()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        seen = {
            "active": wd.active,
            "store": wd._store is not None,
        }
        wd.stop()  # atexit's call in a child: must not publish "closed" for the rank
        os.write(w, json.dumps(seen).encode())
        os._exit(0)
    os.close(w)
    inherited = json.loads(os.read(r, 4096))
    wait_child(pid, 5.0)
    ours = signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
    parent = {"active": wd.active, "sigterm_ours": ours}
    watch.uninstall()
    wd.stop()
    print(
        json.dumps(
            {
                "hung": hung,
                "children": n,
                "inherited": inherited,
                "parent": parent,
            }
        )
    )


if __name__ == "__main__":
    main()
