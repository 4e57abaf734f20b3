"""Framework state that a survivor must drop before it runs the script again.

A hot recovery runs the script again inside each survivor's process (resilient/worker.py),
where every imported module keeps its state. Accelerate keeps the process's distributed state
(its rank, its device, whether the process group is made) in class-level singletons:
`PartialState`, `AcceleratorState` and `GradientState`. A survivor's second `Accelerator()`
finds them filled in and skips `init_process_group`, while the replacement, a fresh process,
calls it and waits there for the survivor, which waits for the replacement in the runtime's
roll call: both wait until the roll call's start-up timeout (6 minutes by default), then the
recovery goes cold. So the survivor empties them first, through the reset Accelerate's own
tests use between runs (`_reset_state`), and its `Accelerator()` makes the group again as the
replacement's does. The Hugging Face Trainer reads the same singletons.

Only a framework the script already imported is touched: the runtime imports none. Where a
release lacks these resets, the survivor goes cold at once, with the reason, rather than hang.
"""

from __future__ import annotations

import sys

from resilient import events as ev
from resilient.exitcodes import ExitCode
from resilient.groups.exits import hard_exit
from resilient.log import get_logger

__all__ = ["forget_framework_state"]

_ACCELERATE_SINGLETONS = ("AcceleratorState", "PartialState", "GradientState")


def forget_framework_state() -> list[str]:
    """Empty the singletons of the frameworks imported in this process (the module's
    docstring); the names of those emptied. Exits PEER_LOST (the agent restarts the group
    cold) where one cannot be emptied."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return []
    classes = [getattr(state, name, None) for name in _ACCELERATE_SINGLETONS]
    missing = [
        name
        for name, cls in zip(_ACCELERATE_SINGLETONS, classes, strict=True)
        if not callable(getattr(cls, "_reset_state", None))
    ]
    if missing:
        version = getattr(sys.modules.get("accelerate"), "__version__", "?")
        reason = (
            f"accelerate {version} has no {', '.join(m + '._reset_state' for m in missing)}: "
            "this survivor cannot drop its process state, and its script's Accelerator() "
            "would not make the new generation's process group; restarting cold. Use an "
            "accelerate release from 1.10 on, or run without --hot-recovery."
        )
        get_logger().error(ev.RECOVERY_COLD, reason=reason)
        hard_exit(ExitCode.PEER_LOST)
    for cls in classes:
        cls._reset_state()  # type: ignore[union-attr]
    get_logger().info(ev.RECOVERY_HOT_FRAMEWORK_RESET, singletons=list(_ACCELERATE_SINGLETONS))
    return list(_ACCELERATE_SINGLETONS)
