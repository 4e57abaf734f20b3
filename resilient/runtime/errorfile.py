"""An uncaught exception in a worker, recorded where the launcher looks for it.

torch elastic gives each worker an error file (TORCHELASTIC_ERROR_FILE) that its `@record`
decorator fills; scripts rarely use it. `install_excepthook()` does the same for any uncaught
exception in the main thread and logs `worker.exception` with the step, so `resilient run`
can name the rank, the exception and the step of a repeating failure.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

from resilient.errors import CheckpointMismatchError, ConfigError
from resilient.exitcodes import ExitCode
from resilient.groups._torch_compat import micro_batch_sizes
from resilient.groups.exits import hard_exit
from resilient.log import get_logger
from resilient.runtime.stages import uneven_micro_batches

__all__ = ["install_excepthook"]


def _mismatch(exc: BaseException, step: Callable[[], int | None]) -> BaseException | None:
    """`exc` or its cause that is a ConfigError or CheckpointMismatchError, if any; torch's
    own refusal of uneven pipeline micro-batches (torch < 2.13) as the runtime's."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, ConfigError | CheckpointMismatchError):
            return cause
        sizes = micro_batch_sizes(cause)
        if sizes is not None:
            return uneven_micro_batches(_step_or_none(step), list(sizes))
        seen.add(id(cause))
        cause = cause.__cause__
    return None


def install_excepthook(
    step: Callable[[], int | None], *, divert: Callable[[BaseException], None] | None = None
) -> Callable[[], None]:
    """Chain a sys.excepthook that writes the error file and logs; returns an uninstaller.

    A configuration or checkpoint mismatch (ConfigError, CheckpointMismatchError) is recorded
    and ends the process with ExitCode.MISMATCH: a restart would meet it again, so the
    supervisor stops instead of restarting it up to the crash-loop limit. Anything else:
    `divert`, when given, sees the exception first and may end the process itself (the
    runtime does for a collective that failed because a peer is gone); if it returns, the
    exception is recorded as usual."""
    previous = sys.excepthook
    pid = os.getpid()

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        # a forked child (a DataLoader worker) is not the rank: its errors are not the rank's
        if not issubclass(exc_type, KeyboardInterrupt) and os.getpid() == pid:
            # torch re-raises a module's error as its own (a pipeline stage's "Failed to run
            # stage forward"): the cause tells
            cause = _mismatch(exc, step)
            if cause is not None:
                _record(cause, step, exit_code=int(ExitCode.MISMATCH))
                previous(exc_type, exc, tb)
                hard_exit(ExitCode.MISMATCH)  # no restart would help: not one of the peers'
            if divert is not None:
                divert(exc)
            _record(exc, step)
        previous(exc_type, exc, tb)

    sys.excepthook = hook

    def uninstall() -> None:
        if sys.excepthook is hook:
            sys.excepthook = previous

    return uninstall


def _step_or_none(step: Callable[[], int | None]) -> int | None:
    try:
        return step()
    except Exception:  # the runtime may be half torn down; the exception matters more
        return None


def _record(
    exc: BaseException, step: Callable[[], int | None], *, exit_code: int | None = None
) -> None:
    at: Any = _step_or_none(step)
    get_logger().error(
        "worker.exception",
        error=f"{type(exc).__name__}: {exc}"[:1000],
        step=at,
        traceback="".join(traceback.format_exception(exc))[-4000:],
        **({"exit_code": exit_code} if exit_code is not None else {}),
    )
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)  # no-op without TORCHELASTIC_ERROR_FILE
    except Exception as e:  # never mask the original error with a reporting one
        print(f"resilient: could not write the error file: {e}", file=sys.stderr)
