"""A script that makes its own process group, under --hot-recovery, whose re-run in the
survivor does not make it again (a framework's singleton says it is made; Accelerate's is
emptied by the runtime, an unknown one cannot be): the replacement waits in its
init_process_group, the survivor in the roll call. The survivor names that within one look
and the group restarts cold, instead of both waiting out the start-up timeout (6 minutes)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import Launcher, recipe_cmd, tiny_ddp_loop

from resilient.exitcodes import ExitCode

_PRELUDE = """\
import sys, types
import torch.distributed as dist

# what a framework keeps in a module: set once per process, still set in a hot re-run
state = sys.modules.setdefault("a_framework_state", types.ModuleType("a_framework_state"))
if not getattr(state, "group_made", False):
    dist.init_process_group("gloo")
    state.group_made = True
"""
_SCRIPT = tiny_ddp_loop(steps=24, sleep_s=0.05, prelude=_PRELUDE)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_survivor_whose_script_skips_its_own_group_goes_cold_at_once(
    tmp_path: Path, launcher: Launcher
) -> None:
    script = tmp_path / "own_group.py"
    script.write_text(_SCRIPT)
    cmd = recipe_cmd(
        str(script), tmp_path, "--hot-recovery", faults=("kill@rank=1,step=12,phase=step",)
    )
    watchdog = '{"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 3}'
    t0 = time.monotonic()
    snapshot = '{"enabled": true, "every_steps": 1}'
    env = {"RESILIENT_WATCHDOG": watchdog, "RESILIENT_SNAPSHOT": snapshot}
    code, _, err = launcher.run(cmd, timeout=170, env=env)
    took = time.monotonic() - t0
    assert code == ExitCode.OK, err[-4000:]
    assert "wait in the script's own init_process_group for generation 1" in err, err[-4000:]
    assert "from_checkpoint=True" in err  # the cold restart resumed from storage
    assert took < 120, f"{took:.0f} s: the roll call waited out its start-up timeout"


@pytest.mark.timeout(60)
def test_the_look_reads_the_generations_script_store() -> None:
    """Keys in the script store and no process group here: True; an empty store, or one
    whose host is gone: False, and at once (no store client retrying a refused port)."""
    from torch.distributed import TCPStore

    from resilient.hot import script_store

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    script_store._POINTED[7] = ("127.0.0.1", server.port)
    try:
        assert not script_store.script_group_formed_without_me(7)
        server.set("rank_1", "addr")  # what a rank's init_process_group leaves there
        assert script_store.script_group_formed_without_me(7)
        assert not script_store.script_group_formed_without_me(8)  # not pointed there
        port = server.port
        del server
        t0 = time.monotonic()
        script_store._POINTED[7] = ("127.0.0.1", port)
        assert not script_store.script_group_formed_without_me(7)
        assert time.monotonic() - t0 < 1.5
    finally:
        script_store._POINTED.pop(7, None)
