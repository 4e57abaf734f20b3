"""`resilient run`: a restart supervisor on torch elastic's agent.

Exit codes: resilient.exitcodes.ExitCode (PREEMPTED, CRASH_LOOP, RESTARTS_EXHAUSTED,
USAGE). The supervisor imports torch elastic; importing this package starts nothing.
"""

from resilient.supervisor.launcher import main
from resilient.supervisor.policy import RestartPolicy

__all__ = ["RestartPolicy", "main"]
