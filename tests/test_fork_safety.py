"""A process forked from a rank (a DataLoader worker) while the runtime's threads are busy.

Forking copies every lock in whatever state it is in, held by threads the child does not
have. The event log's lock is held across fork, so a child's first event cannot hang; the
watchdog is inert in a child (groups/forksafe.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.procs import REPO

pytestmark = pytest.mark.timeout(120)


def test_children_forked_while_a_thread_logs_log_and_the_runtime_is_inert(tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(REPO / "tests/workers/fork_children.py"), str(tmp_path), "20"],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # without the lock held across fork, 23 of 30 such children hung on their first event
    assert seen["hung"] == 0, seen
    lines = (tmp_path / "logs" / "rank0.jsonl").read_text().splitlines()
    children = {json.loads(x)["child"] for x in lines if '"test.child"' in x}
    assert children == set(range(20))
    assert all(json.loads(x) for x in lines)  # no line torn by a child writing mid-line
    assert seen["inherited"] == {"active": False, "store": False}
    assert seen["parent"] == {"active": True, "sigterm_ours": True}  # the rank keeps both
