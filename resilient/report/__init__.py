"""What a run's event logs say about it (`resilient report`).

- `analysis`: goodput, faults, each recovery (hot rollback, hot replacement, OOM retry or
  cold restart) and the Young/Daly optimum, from the logs alone;
- `text`: the report as text;
- `timeline`: the timeline as a PNG (matplotlib, the "report" extra).
"""

from resilient.report.analysis import (
    COLD,
    HOT_REPLACEMENT,
    HOT_ROLLBACK,
    RETRY,
    FaultReport,
    RunReport,
    analyze,
    load_events,
    young_daly,
)
from resilient.report.text import format_report
from resilient.report.timeline import plot_timeline

__all__ = [
    "COLD",
    "HOT_REPLACEMENT",
    "HOT_ROLLBACK",
    "RETRY",
    "FaultReport",
    "RunReport",
    "analyze",
    "format_report",
    "load_events",
    "plot_timeline",
    "young_daly",
]
