"""chaos.quiet's elastic resize: a healthy run whose world grows mid-run, with no fault.

Node A (`resilient run --nnodes 1:2`, c10d rendezvous on 127.0.0.1, hosting the store)
trains alone. Once its rank 0 has done `at_step` steps and learned its timeouts, node B
(the same command, its own run directory) joins. A's agent sees a node waiting and stops
its healthy group with SIGTERM: the workers save at the next step and leave
(`restart.membership`). Both agents start the next round at twice the world size, resuming
from that checkpoint. That is torch elastic's membership change, a legitimate event: the
only restart it may cause, with no verdict anywhere.

The new world must not judge by the old world's learned timeouts (its step times differ):
the checkpoint's table is dropped and learned again after the warm-up, under the fixed
timeouts. The resize makes that visible: one rank that exists only in the new world takes
`seconds` longer in its first step (judged by the first-step timeout) and again in its
fourth (a warm step inside the new warm-up), both longer than the old world's table.

Node B is started with the run, its imports done, and waits for a trigger file
(`python -m chaos.quiet_resize --when FILE -- run ARGS`), so it joins within a second or
two rather than after an interpreter's start.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chaos.procs import Run
from chaos.ranks import free_port
from resilient.events import EventTail, timestamp

__all__ = ["check_resize", "run_resized", "specs"]

STEP_WARM = 3
"""Forwards of the new world's rank before its slow warm step (its fourth step)."""


def specs(nproc: int, seconds: float) -> list[str]:
    """The new world's two slow steps (chaos/faults.py), on rank `nproc`: no rank of that
    number exists before the grow, whichever node it lands on."""
    once = f"slow@rank={nproc},phase=forward,times=1,seconds={seconds:g}"
    return [once, f"{once},skip={STEP_WARM}"]


def rendezvous(port: int, host: bool, rdzv_id: str) -> list[str]:
    return [
        "--nnodes=1:2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={rdzv_id}",
        # a late node joins the next round after 1 s; torch's default keep-alive (5 s):
        # shorter ones were seen to starve a late join on a loaded host (docs/internals.md)
        f"--rdzv-conf=is_host={int(host)},last_call_timeout=1,join_timeout=120",
        "--local-addr=127.0.0.1",
    ]


def run_resized(
    name: str,
    at_step: int,
    out: Path,
    argv: Callable[[Path, list[str]], list[str]],
    env: dict[str, str],
    timeout_s: float,
) -> list[int | None]:
    """Node A and node B (module doc); `argv(run_dir, rendezvous)` is a node's `python -m
    resilient.cli run ...` command. Returns both exit codes (None: killed at the timeout)."""
    port = free_port()
    trigger = out / "join"
    cmd_a = argv(out / "run", rendezvous(port, True, name))
    cmd_b = argv(out / "run-B", rendezvous(port, False, name))
    # B runs `resilient run` in a process that imported it before the trigger
    joiner = [sys.executable, "-m", "chaos.quiet_resize", "--when", str(trigger), "--"]
    joiner += cmd_b[cmd_b.index("run") :]
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = [None, None]
    with (
        Run(cmd_a, log_path=out / "launcher.log", env=env) as a,
        Run(joiner, log_path=out / "launcher-B.log", env=env) as b,
    ):
        tail = EventTail(out / "run" / "logs", pattern="rank0.jsonl")
        step, learned = -1, False
        # a resize of a group that has learned its timeouts: on a fast host the first table
        # may come after at_step
        while (step < at_step or not learned) and time.monotonic() < deadline:
            if a.proc.poll() is not None:
                break
            for e in tail.read_new():
                if e.get("event") == "step.fingerprint":
                    step = max(step, int(e["step"]))
                learned |= e.get("event") == "hang.timeouts" and bool(e.get("timeouts_s"))
            time.sleep(0.05)
        joined = step >= at_step and learned
        if joined:
            _note_join(out / "run", step)
            trigger.touch()
        else:
            b.kill()  # A ended or the time ran out first: B never joins
        for i, r in enumerate((a, b) if joined else (a,)):
            with contextlib.suppress(TimeoutError):  # Run.wait killed it: code None
                codes[i] = r.wait(max(1.0, deadline - time.monotonic()))
    return codes


def _note_join(run_dir: Path, step: int) -> None:
    """The join, in A's chaos.jsonl, where `resilient report` reads the faults sent from
    outside (chaos/external.py): a resize is an event of the scenario, not a fault."""
    from chaos.external import _record

    _record(run_dir, t=time.time(), kind="node_join", target_rank=-1, step=step)


def check_resize(
    evs: list[dict[str, Any]], nproc: int, steps: int, warmup: int
) -> tuple[dict[str, bool], dict[str, Any]]:
    """The resize's checks over both nodes' events, and what they saw."""
    # in time order: rank 0 may change nodes with the resize
    by = _by_name(sorted(evs, key=lambda e: timestamp(e) if "ts" in e else 0.0))
    starts = sorted(by("attempt.start"), key=timestamp)
    members = by("restart.membership")
    worlds = sorted((e["step"], e["world"]) for e in by("step.fingerprint") if e.get("rank") == 0)
    before = [s for s, w in worlds if w == nproc]
    after = [s for s, w in worlds if w == 2 * nproc]
    resumes = [e for e in by("runtime.resume") if e.get("rank") == 0 and e.get("from_checkpoint")]
    resumed = int(resumes[-1]["step"]) if resumes else None
    member_t = min((timestamp(e) for e in members), default=None)
    saved = [
        int(e["step"])
        for e in by("ckpt.save.committed")
        if e.get("rank") == 0 and member_t is not None and timestamp(e) < member_t
    ]
    # rank 0's phase tables after the resume: the first one only once the new world is warm
    # (an event that only says the heartbeat timeout was learned, within seconds, is not one)
    resume_t = timestamp(resumes[-1]) if resumes else None
    relearned = [
        e
        for e in by("hang.timeouts")
        if e.get("rank") == 0
        and e.get("timeouts_s")
        and resume_t is not None
        and timestamp(e) > resume_t
    ]
    first = relearned[0] if relearned else {}
    done = [e for e in by("runtime.done") if e.get("rank") == 0]
    lost = (max(before) + 1 - resumed) if before and resumed is not None else None
    checks = {
        "resize: the agent's membership-change restart, once": len(members) == 1,
        "resize: attempts at world n, then both nodes at 2n": (
            [e.get("world_size") for e in starts] == [nproc, 2 * nproc, 2 * nproc]
            and len({e.get("attempt") for e in starts[1:]}) == 1
        ),
        "resize: steps ran at n, then at 2n": bool(before and after) and max(before) < min(after),
        "resize: resumed no earlier than the last checkpoint": (
            resumed is not None and resumed >= max(saved, default=0) and lost is not None
        ),
        "resize: the final step reached": bool(done) and int(done[-1]["step"]) == steps,
        "resize: the old table dropped, learned again after the warm-up": (
            bool(first.get("timeouts_s"))
            and resumed is not None
            and int(first.get("step", -1)) >= resumed + warmup
        ),
    }
    facts = {
        "worlds": [nproc, 2 * nproc] if before and after else sorted({w for _, w in worlds}),
        "last_step_before": max(before, default=None),
        "resumed_at": resumed,
        "steps_lost": lost,
        "relearned_at_step": first.get("step"),
        "learned_after_s": dict(first.get("timeouts_s") or {}),
    }
    return checks, facts


def _by_name(evs: list[dict[str, Any]]) -> Callable[[str], list[dict[str, Any]]]:
    def get(name: str) -> list[dict[str, Any]]:
        return [e for e in evs if e.get("event") == name]

    return get


def main(argv: list[str] | None = None) -> int:
    """`--when FILE -- run ARGS`: import the launcher, wait for FILE, run `resilient run`."""
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--")
    when = Path(argv[argv.index("--when") + 1])
    import resilient.supervisor  # noqa: F401  (the imports a fresh start would pay at the join)
    from resilient.cli import main as cli

    while not when.exists():
        time.sleep(0.05)
    return cli(argv[cut + 1 :])


if __name__ == "__main__":
    sys.exit(main())
