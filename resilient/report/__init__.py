"""What a run's event logs say about it (`resilient report`).

- `goodput`: `analyze`, goodput and save cost, from the logs alone (`logs`: reading them back);
- `recovery`: each recovery (hot rollback, hot replacement, OOM retry or cold restart) and
  its fault;
- `optimum`: the Young/Daly optimum;
- `results`: what `analyze` returns;
- `text`: the report as text;
- `timeline`: the timeline as a PNG (matplotlib, the "report" extra).
"""

from resilient.report.goodput import analyze
from resilient.report.logs import load_events
from resilient.report.optimum import young_daly
from resilient.report.results import (
    COLD,
    HOT_REPLACEMENT,
    HOT_ROLLBACK,
    RETRY,
    FaultReport,
    RunReport,
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
