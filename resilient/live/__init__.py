"""Live view of a running job, from its event logs: Prometheus metrics and a status line.

`resilient run --metrics-port PORT --status MODE` starts a LiveMonitor (monitor.py) in the
supervisor; `resilient check-resume` and the benchmarks draw their progress with StatusLine
(status.py). The modules: follow.py reads the logs as they grow, state.py folds their events
into the run's state, goodput.py computes the report's goodput so far, metrics.py exports the
state, status.py draws it (docs/metrics.md).
"""
