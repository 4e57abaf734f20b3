"""Reading DCP's CheckpointException, which wraps every failing rank's exception.

Its str is every rank's full traceback: the save and load paths log one line per rank instead,
name the first rank's error to the user, and pick out the verification problems a load found.
"""

from __future__ import annotations

from torch.distributed.checkpoint import CheckpointException

from resilient.checkpoint._dcp_read import VerificationFailed

__all__ = ["first_failure", "verification_problems", "why"]


def first_failure(e: BaseException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException, else `e` itself."""
    failures = getattr(e, "failures", None)
    if isinstance(e, CheckpointException) and isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        exc = first[0] if isinstance(first, tuple) else first
        if isinstance(exc, BaseException):
            return exc
    return e


def verification_problems(e: BaseException) -> list[str]:
    """The problems of a VerificationFailed raised inside dcp.load (in its CheckpointException)."""
    failures = getattr(e, "failures", None)
    found: list[str] = []
    if isinstance(e, CheckpointException) and isinstance(failures, dict):
        for failure in failures.values():
            exc = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(exc, VerificationFailed):
                found += exc.problems
    return found


def why(e: BaseException) -> str:
    """One line per failing rank for DCP's CheckpointException (its str is full tracebacks)."""
    failures = getattr(e, "failures", None)
    if isinstance(e, CheckpointException) and isinstance(failures, dict) and failures:
        parts = []
        for rank, failure in sorted(failures.items()):
            exc = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        return "; ".join(parts)
    return f"{type(e).__name__}: {e}"
