"""The exit codes a worker uses to tell its launcher why it left, in one table.

A scheduler or `resilient run` reads them to decide between restarting the group, requeueing
the job, and giving up. They sit in 80-89, clear of the shell's 126-165 (128 + signal), of
sysexits.h (64-78) and of Python's 1 (an unhandled exception) and 2 (a usage error).

Every rank of a group that the watchdog or the guard takes down exits with the same code, so
the first failure torchrun reports names the cause, not a side effect such as "connection
closed by peer".
"""

from __future__ import annotations

import enum

__all__ = ["DESCRIPTIONS", "RESTARTABLE", "ExitCode", "describe"]


class ExitCode(enum.IntEnum):
    """Why a worker exited. The values are stable: scripts and job specs may hard-code them.

    `DESCRIPTIONS` says what each means and what to do about it.
    """

    OK = 0
    MISMATCH = 80
    HANG = 81
    PEER_LOST = 82
    OOM = 83
    RANK_EXCEPTION = 84
    PREEMPTED = 85
    CRASH_LOOP = 86
    NUMERICAL_FAULT = 87
    RESTARTS_EXHAUSTED = 88
    NODE_EXCLUDED = 89
    USAGE = 2
    """Python's and argparse's usage-error code, kept for `resilient run`'s own checks."""


DESCRIPTIONS: dict[ExitCode, str] = {
    ExitCode.OK: "training finished (or stopped at stop_at) with a committed checkpoint",
    ExitCode.MISMATCH: (
        "the configuration or a checkpoint does not fit the run: a checkpoint of another "
        "model or with layers this model lacks (the keys are named), ranks that would save "
        "different values under one name, a pipeline split that differs between ranks, a "
        "bad option (ConfigError). A restart would meet it again: resilient run stops at once. "
        "Do not requeue: fix the script or the checkpoint location"
    ),
    ExitCode.HANG: (
        "a rank made no progress past its phase timeout, or stopped heartbeating while its "
        "process was stopped (SIGSTOP); the hang.detected event names it. Restart"
    ),
    ExitCode.PEER_LOST: (
        "a rank died (no heartbeat, closed connections) or the store became unreachable; "
        "the fault.detected event names it when known. Restart"
    ),
    ExitCode.OOM: (
        "a rank ran out of memory and the group could not retry in place (FSDP, a failure "
        "after the gradient sync began, or the micro-batch floor reached); the next attempt "
        "starts with the smaller micro-batch split. Restart"
    ),
    ExitCode.RANK_EXCEPTION: (
        "a rank raised inside a guard and every rank left together; guard.failure holds the "
        "traceback. Restart (crash-loop detection stops a repeating one)"
    ),
    ExitCode.PREEMPTED: (
        "preempted (SIGTERM/SIGUSR1): every rank stopped at one agreed step and committed a "
        "checkpoint there if it fitted in the grace period (else the previous one stays the "
        "newest valid); requeue"
    ),
    ExitCode.CRASH_LOOP: (
        "resilient run: consecutive restarts made no checkpoint progress; the supervisor "
        "report names the repeating failure. Do not requeue: fix the cause"
    ),
    ExitCode.NUMERICAL_FAULT: (
        "a non-finite loss, gradient or checkpoint value (or a loss spike) came back on the "
        "same step with the same inputs: the data or the model, not the hardware. The "
        "numeric.fault events name the step, rank and batch; every good checkpoint is kept. "
        "Do not requeue: fix the data or the model, or skip the batch (numeric policy)"
    ),
    ExitCode.RESTARTS_EXHAUSTED: (
        "resilient run: --max-restarts restarts were used up while checkpoints still "
        "advanced; requeueing resumes from the newest checkpoint"
    ),
    ExitCode.NODE_EXCLUDED: (
        "resilient run: this node left the job before a rendezvous round: it failed a health "
        "check (the report names each check with its measured value) or stayed a straggler "
        "(--evict-stragglers). With --nnodes MIN:MAX the other nodes go on without it. Fix or "
        "replace the node; do not requeue it as it is"
    ),
    ExitCode.USAGE: (
        "bad command line or configuration (unknown flag, missing script, invalid value); "
        "nothing was started. Do not requeue: fix the command"
    ),
}

RESTARTABLE = frozenset({ExitCode.HANG, ExitCode.PEER_LOST, ExitCode.OOM, ExitCode.RANK_EXCEPTION})
"""Codes after which restarting the group from the newest checkpoint is the right move."""


def describe(code: int) -> str:
    """A one-line explanation of an exit code, resilient's or not (for reports and logs)."""
    try:
        member = ExitCode(code)
    except ValueError:
        if code < 0 or code > 128:
            return f"killed by signal {-code if code < 0 else code - 128}"
        return f"exit code {code} (not one of resilient's)"
    return f"{member.name} ({int(member)}): {DESCRIPTIONS[member]}"
