"""The two-host flow: host A (the rendezvous host) and host B in network namespaces, one
`resilient run` each with --nnodes 1:2, and a node loss at the fault's step: every process of
host B is killed, and A's group must finish the run alone from the resharded checkpoint.
"""

from __future__ import annotations

import time

from chaos.external import Injected, _record
from chaos.launch import _Env, _launch_cmd
from chaos.netns import Hosts
from chaos.observe import _inits, _printed_steps
from chaos.plan import Planned
from chaos.procs import Run, alive, descendants, wait_for

__all__ = ["_two_hosts"]


def _two_hosts(
    env: _Env,
    hosts: Hosts,
    planned: list[Planned],
    proc_env: dict[str, str],
    injected: list[Injected],
    failures: list[str],
    leftover: list[int],
    started: float,
) -> int | None:
    """Host A (rendezvous host) and host B, `sc.nproc` workers each, --nnodes 1:2. At the
    fault every process of host B is killed; A's group restarts alone from the newest
    checkpoint (resharded) and must finish the run."""
    sc, out = env.sc, env.out

    def launch(i: int) -> Run:
        rendezvous = [
            "--nnodes=1:2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={hosts.addr[0]}:29400",  # each namespace has its own ports
            f"--rdzv-id={sc.name}",
            f"--rdzv-conf=is_host={int(i == 0)},last_call_timeout=1,keep_alive_interval=1,"
            "keep_alive_max_attempt=3,join_timeout=120",
            f"--local-addr={hosts.addr[i]}",
        ]
        cmd = _launch_cmd(sc, out, env.ckpt_url, sc.max_restarts, [], rendezvous)
        log = out / ("stdout.log" if i == 0 else "stdout-B.log")
        return Run([*hosts.exec_prefix(i), *cmd], log_path=log, env=proc_env)

    def printed() -> int:
        logs = [out / "stdout.log", out / "stdout-B.log"]
        text = "".join(p.read_text(errors="replace") for p in logs if p.exists())
        return max(_printed_steps(text), default=-1)

    with launch(1) as b:  # B waits for A's rendezvous store, so both join the first round
        wait_for(
            lambda: any((env.run_dir / "logs").glob("supervisor*.jsonl")),
            timeout=60,
            what="host B's supervisor at its rendezvous",
        )
        with launch(0) as a:
            rc: int | None = None
            try:
                (p,) = planned
                wait_for(
                    lambda: printed() >= p.fault.at_step,
                    timeout=sc.timeout_s,
                    what=f"step {p.fault.at_step} on two hosts",
                )
                victim = _inits(env.run_dir, p.fault.rank)[0]
                completed = printed() + 1
                t = time.time()
                hosts.kill(1)
                _record(env.run_dir, kind="node_loss", target_rank=p.fault.rank, host=1, t=t)
                injected.append(
                    Injected(
                        kind="node_loss",
                        rank=p.fault.rank,
                        pid=int(victim["pid"]),
                        wall_time=t,
                        attempt=0,
                        completed=completed,
                    )
                )
                rc = a.wait(max(1.0, sc.timeout_s - (time.monotonic() - started)))
            except TimeoutError as e:
                failures.append(f"d: {e}")
                a.kill()
            time.sleep(0.5)
            pids = {int(e["pid"]) for r in range(2 * sc.nproc) for e in _inits(env.run_dir, r)}
            leftover += [q for q in (*descendants(a.proc.pid), *pids) if alive(q)]
            leftover += [q for i in range(2) for q in hosts.pids(i) if q not in (a.proc.pid,)]
            b.proc.poll()
    return rc
