"""A hot recovery's survivor empties the framework singletons that would make its re-run
script skip its process group (resilient/hot/framework_state.py); the whole recovery is in
tests/test_accelerate_loop.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from resilient.exitcodes import ExitCode
from resilient.hot.framework_state import forget_framework_state


@pytest.mark.timeout(60)
def test_accelerate_singletons_are_emptied_and_nothing_else_is_touched() -> None:
    accelerate_state = pytest.importorskip("accelerate.state")
    accelerate_state.PartialState(cpu=True)  # one process, no group: fills the singleton
    accelerate_state.GradientState()
    assert accelerate_state.PartialState._shared_state
    assert forget_framework_state() == ["AcceleratorState", "PartialState", "GradientState"]
    assert not accelerate_state.PartialState._shared_state
    assert not accelerate_state.GradientState._shared_state
    assert not accelerate_state.AcceleratorState._shared_state


_WITHOUT_RESET = """
import sys, types
fake = types.ModuleType("accelerate.state")
class PartialState:  # a release without _reset_state
    _shared_state = {"initialized": True}
fake.PartialState = fake.AcceleratorState = fake.GradientState = PartialState
sys.modules["accelerate.state"] = fake
from resilient.hot.framework_state import forget_framework_state
forget_framework_state()
print("went on")
"""


@pytest.mark.timeout(60)
def test_a_release_without_the_reset_goes_cold_at_once_with_the_reason() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_RESET], capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == ExitCode.PEER_LOST
    assert "went on" not in proc.stdout
    out = proc.stdout + proc.stderr
    assert "recovery.cold" in out and "PartialState._reset_state" in out, out[-2000:]
    assert "run without --hot-recovery" in out
