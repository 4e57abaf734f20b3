"""The suite fails when a test is skipped for a reason nobody expected (issue 49).

A skip that says "no etcd binary" on a fresh CI machine kept two tests from ever running
while CI stayed green. So every skip's reason is compared with EXPECTED_SKIPS, the one
allow-list: a reason that contains none of them fails the session (exit 1) and is listed in
the summary with its test. A machine that truly cannot run a test (no root for network
namespaces, no way to install etcd) names it in TEST_EXPECTED_SKIPS, '|'-separated
substrings, for that run only: `TEST_EXPECTED_SKIPS='no etcd binary' make test`.

tests/conftest.py takes the hooks below; `python -m pytest -p skipcheck` loads them alone
(tests/test_skipcheck.py).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

__all__ = [
    "EXPECTED_SKIPS",
    "pytest_collectreport",
    "pytest_runtest_logreport",
    "pytest_sessionfinish",
    "pytest_terminal_summary",
]

EXPECTED_SKIPS = (
    "needs a CUDA device",  # tests/test_gpu.py on a machine without CUDA
    "this machine has an NVIDIA driver",  # tests/test_health.py's no-GPU check, on a GPU host
    "no posix_fadvise here",  # not Linux
)
"""Substrings of the skip reasons that are expected anywhere; every other skip fails."""

_UNEXPECTED: list[tuple[str, str]] = []


def _reason(report: Any) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def expected(reason: str) -> bool:
    extra = [p for p in os.environ.get("TEST_EXPECTED_SKIPS", "").split("|") if p.strip()]
    return any(p.strip() in reason for p in (*EXPECTED_SKIPS, *extra))


def _note(report: Any) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _reason(report)
        if not expected(reason):
            _UNEXPECTED.append((report.nodeid, reason))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: its controller decides
        return
    if _UNEXPECTED and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _UNEXPECTED or hasattr(terminalreporter.config, "workerinput"):
        return
    terminalreporter.section("unexpected skips: the session fails", red=True)
    for nodeid, reason in _UNEXPECTED:
        terminalreporter.line(f"{nodeid}: {reason}")
    terminalreporter.line(
        "Expected skips are listed in tests/skipcheck.py (EXPECTED_SKIPS); on a machine that "
        "cannot run these, name them in TEST_EXPECTED_SKIPS='reason|reason'."
    )
