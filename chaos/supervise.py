"""Run the `resilient` command with a fault armed inside the launcher's agent.

    python -m chaos.supervise --kill-stopped -- run --hot-recovery ... script.py ARGS

`--kill-stopped`: each time the agent has looked at its workers' exits and before it acts on
them (the `agent.looked` fault point, resilient/faultpoints.py), SIGKILL any worker that is
stopped (SIGSTOP) and wait until it has exited. This drives the one ordering that made a hot
recovery go cold now and then: a stopped rank killed by its peer's watchdog right after the
agent's look, so that the next thing to see its exit is not that look but torch's own poll,
which stops every other worker. Pair it with chaos.inject's `stop@rank=R,step=S` in the
workers. The kill is logged as one `chaos.fault` line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time


def _kill_stopped(pids: dict[int, int]) -> None:
    from resilient.supervisor.procs import is_stopped, wait_exits

    for local_rank, pid in pids.items():
        if is_stopped(pid):
            os.kill(pid, signal.SIGKILL)
            code = wait_exits({local_rank: pid}, 10.0, 0.005)[local_rank]
            line = {"kind": "kill_stopped", "local_rank": local_rank, "pid": pid, "exit": code}
            print(f"chaos.fault {json.dumps({**line, 'ts': time.time()})}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: python -m chaos.supervise --kill-stopped -- run ARGS")
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m chaos.supervise", description=__doc__)
    p.add_argument("--kill-stopped", action="store_true", help="see the module's doc")
    args = p.parse_args(argv[:cut])
    from resilient import faultpoints
    from resilient.cli import main as resilient_main

    if args.kill_stopped:
        faultpoints.arm(faultpoints.AGENT_LOOKED, _kill_stopped)
    raise SystemExit(resilient_main(argv[cut + 1 :]))


if __name__ == "__main__":
    main()
