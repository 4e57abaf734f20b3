"""Node health checks, run by `resilient run` on every node before each rendezvous round: a
node that fails one does not join (docs/health.md).

- `report`: HealthInputs, CheckResult, HealthReport;
- `storage`: the checkpoint location answers, is writable, has room for one more checkpoint;
- `host`: /dev/shm for DataLoader workers, host memory for in-memory snapshots;
- `gpu`: every visible GPU answers NVML without faults that need a reset;
- `command`: the user's own check (--health-check CMD);
- `node`: check_node, all of them at once, each logged.

Imports neither the supervisor nor, until a checkpoint location is checked, the checkpoint
package (which loads DCP).
"""

from resilient.health.node import check_node
from resilient.health.report import CheckResult, HealthInputs, HealthReport

__all__ = ["CheckResult", "HealthInputs", "HealthReport", "check_node"]
