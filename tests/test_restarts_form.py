"""Restarts that form for any script: a script that makes its own process group (as every
framework does) restarts under `resilient run` as reliably as one that uses resilient.init().

Before each round's workers start, the supervisor's agent hosts a fresh store and points
MASTER_ADDR:MASTER_PORT at it (resilient/supervisor/agent.py). torch's own agent store
outlives the round: a restarted `init_process_group("gloo")` read the last attempt's peer
addresses there and died of "Connection refused" or hung in gloo's connectFullMesh (seen in
2 of 3 such runs here before the change; docs/internals.md#g-per-attempt-store).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from helpers import REPO_ROOT, Launcher, run_cmd

from resilient.exitcodes import ExitCode

# the 8-line script of a user, plus a record of each attempt's formed group and a kill
_PLAIN = textwrap.dedent(
    """\
    import json, os, sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    t = torch.ones(1)
    dist.all_reduce(t)  # the group formed: every rank connected to every other
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps({"rank": rank, "attempt": attempt, "sum": t.item()}) + "\\n")
    for i in range(12):
        dist.all_reduce(t); time.sleep(0.01)
        if attempt < int(sys.argv[2]) and rank == 1 and i == 5:
            os.kill(os.getpid(), 9)
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_script_that_makes_its_own_group_forms_after_every_kill(
    tmp_path: Path, launcher: Launcher
) -> None:
    """Rank 1 is SIGKILLed mid-run in each of 10 attempts; every restart forms its group
    (an all-reduce over both ranks) and the 11th attempt finishes: exit 0."""
    kills = 10
    script, rec = tmp_path / "plain.py", tmp_path / "formed.jsonl"
    script.write_text(_PLAIN)
    code, _, err = launcher.run(
        run_cmd(
            "--nproc-per-node=2",
            f"--run-dir={tmp_path / 'run'}",
            f"--max-restarts={kills + 2}",
            f"--crash-loop-restarts={kills + 2}",  # no checkpoints here: no progress to see
            "--restart-backoff=0",
            "--restart-jitter=0",
            str(script),
            str(rec),
            str(kills),
        ),
        timeout=280,
    )
    assert code == ExitCode.OK, err[-4000:]
    formed = [json.loads(line) for line in rec.read_text().splitlines()]
    assert sorted((r["attempt"], r["rank"]) for r in formed) == [
        (a, r) for a in range(kills + 1) for r in (0, 1)
    ]
    assert {r["sum"] for r in formed} == {2.0}
    assert "connectFullMesh" not in err and "Connection refused" not in err


@pytest.mark.slow
@pytest.mark.extended  # `make soak` (20 s): the plain script above runs in CI
@pytest.mark.timeout(400)
def test_a_trainer_script_forms_after_every_kill(tmp_path: Path, launcher: Launcher) -> None:
    """The same for a framework script: recipes/train_hf.py (Accelerate makes its process
    group in TrainingArguments, before the runtime starts) with rank 1 SIGKILLed in 10
    attempts in a row, at its 5th step, before any checkpoint: each restart forms and the
    11th attempt finishes."""
    pytest.importorskip("transformers")
    kills = 10
    faults = [f"kill@rank=1,step=5,restart={k}" for k in range(kills)]
    code, _, err = launcher.run(
        run_cmd(
            "--nproc-per-node=2",
            f"--run-dir={tmp_path / 'run'}",
            f"--checkpoint-url={tmp_path / 'ckpt'}",
            f"--max-restarts={kills + 2}",
            f"--crash-loop-restarts={kills + 2}",  # no checkpoint before step 5: no progress
            "--restart-backoff=0",
            "--restart-jitter=0",
            "-m",
            "chaos.inject",
            *[a for f in faults for a in ("--fault", f)],
            "--",
            str(REPO_ROOT / "recipes" / "train_hf.py"),
            f"--out={tmp_path}",
            "--steps=20",
        ),
        timeout=380,
    )
    assert code == ExitCode.OK, err[-4000:]
    assert err.count("chaos.fault") == kills
    assert (tmp_path / "digest.txt").read_text().startswith("20 ")
    assert "connectFullMesh" not in err and "Connection refused" not in err


# a start stuck before the runtime (as in a framework's own init_process_group), once
_STUCK_START = textwrap.dedent(
    """\
    import os, sys, time
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
        time.sleep(3600)
    import resilient
    rt = resilient.init(sys.argv[1], save_every_steps=None)
    for step in rt.steps(total=3):
        pass
    rt.close()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_start_that_never_reaches_its_first_step_is_named_and_restarted(
    tmp_path: Path, launcher: Launcher
) -> None:
    """Rank 1 hangs before resilient.init() in the first attempt; rank 0 waits for it in
    init_process_group. --start-timeout 4 names both (no event logged yet), kills them and
    restarts: the second attempt finishes, long before any torch timeout."""
    script = tmp_path / "stuck.py"
    script.write_text(_STUCK_START)
    run = tmp_path / "run"
    code, _, err = launcher.run(
        run_cmd(
            "--nproc-per-node=2",
            f"--run-dir={run}",
            "--start-timeout=4",
            "--restart-backoff=0",
            "--restart-jitter=0",
            str(script),
            str(tmp_path / "ckpt"),
        ),
        timeout=150,
    )
    assert code == ExitCode.OK, err[-4000:]
    timeouts = [
        json.loads(line)
        for line in (run / "logs" / "supervisor.jsonl").read_text().splitlines()
        if '"start.timeout"' in line
    ]
    assert len(timeouts) == 1
    assert timeouts[0]["ranks"] == {
        "0": "no event: before resilient.init()",
        "1": "no event: before resilient.init()",
    }


def test_not_started_names_ranks_without_a_first_step() -> None:
    from resilient.supervisor.startwatch import not_started

    records = [
        {"rank": 0, "restart": 1, "event": "runtime.init"},
        {"rank": 0, "restart": 1, "event": "train.progress"},
        {"rank": 1, "restart": 0, "event": "train.progress"},  # an earlier attempt's
        {"rank": 1, "restart": 1, "event": "runtime.resume"},
    ]
    assert not_started(records, 1, [0, 1, 2]) == {1: "runtime.resume", 2: None}
