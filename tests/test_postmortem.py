"""chaos/postmortem.py: what a stuck launch was doing, read before the harness kills it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from helpers import kill_tree, spawn

from chaos import postmortem

pytestmark = pytest.mark.timeout(60)

CHILD = "import time\\ndef child_waits_here():\\n time.sleep(60)\\nchild_waits_here()"
SCRIPT = f"""
import subprocess, sys, time
def parent_waits_here():
    child = subprocess.Popen([sys.executable, "-c", "{CHILD}"])
    print("started", flush=True)
    time.sleep(60)
parent_waits_here()
"""


def test_a_stuck_tree_is_described_with_each_process_stacks_and_last_events(
    tmp_path: Path,
) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(SCRIPT)
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    event = {"event": "recovery.hot.detect", "ts": "T", "generation": 1, "step": 5}
    (logs / "rank2.jsonl").write_text(json.dumps(event) + "\n")
    proc = spawn([sys.executable, str(script)], stdout=-1, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        time.sleep(0.5)  # the child's interpreter reaches its frame
        text = postmortem.describe(proc.pid, tmp_path / "run")
    finally:
        kill_tree(proc.pid, groups=(proc.pid,))
        proc.wait(timeout=10)
    assert "parent_waits_here" in text, text
    assert "child_waits_here" in text, text
    assert "rank2.jsonl: T recovery.hot.detect {'generation': 1, 'step': 5}" in text, text


def test_a_process_already_gone_is_said_to_be() -> None:
    proc = spawn([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    assert postmortem.describe(proc.pid) == ""
