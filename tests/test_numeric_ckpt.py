"""Checkpoints stay good (issue 27): no checkpoint is committed with a NaN or an infinity in its
model or optimizer state, the manifest says it was checked, retention keeps the newest
checkpoint from before the first recorded numerical fault, `resilient ls` shows both, and
`resilient run` does not restart a worker that exits NUMERICAL_FAULT (87)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ForkedCli, Launcher, run_events, run_rank0_exits
from trainee import Trainee

from resilient import CheckpointConfig, CheckpointError, CheckpointManager
from resilient.checkpoint import TieredCheckpointManager
from resilient.checkpoint.faults import FAULTS_NAME, read_faults
from resilient.checkpoint.finite import find_nonfinite
from resilient.checkpoint.manifest import Manifest, step_dir
from resilient.cli import main as cli_main
from resilient.errors import NumericalFaultError
from resilient.exitcodes import ExitCode

pytestmark = pytest.mark.timeout(60)

Events = Callable[..., list[dict[str, Any]]]
REPO = Path(__file__).resolve().parent.parent


def manager(root: Path, **kw: Any) -> CheckpointManager:
    kw.setdefault("async_save", False)
    return CheckpointManager(CheckpointConfig(url=str(root), **kw))


def committed_steps(root: Path) -> list[int]:
    return sorted(int(p.parent.name[5:]) for p in root.glob("step_*/manifest.json"))


def saved(mgr: CheckpointManager, t: Trainee, step: int) -> None:
    t.train(1, seed=step)
    mgr.save(t.state(), step)
    mgr.wait()


# ---------------------------------------------------------------------- the check
def test_the_screen_finds_nan_and_inf_counts_them_and_forgives_an_overflowing_sum() -> None:
    sd = {
        "model": {"a": torch.ones(3), "big": torch.full((4,), 3e38), "n": torch.tensor([0, 1])},
        "optim": {
            "state": {"a": {"exp_avg": torch.tensor([1.0, float("-inf")]).half()}},
            "param_groups": [{"lr": 0.1, "params": ["a"]}],
        },
        "common": torch.tensor([float("nan")]),  # not model or optimizer state
    }
    sd["model"]["b"] = torch.tensor([float("nan"), float("inf"), float("nan"), 2.0])
    found = find_nonfinite(sd)
    assert [(f.key, f.nan, f.inf, f.numel) for f in found] == [
        ("model.b", 2, 1, 4),
        ("optim.state.a.exp_avg", 0, 1, 2),
    ]
    assert find_nonfinite({"model": {"big": torch.full((4,), 3e38)}}) == []  # sum overflows


@pytest.mark.parametrize("async_save", [False, True], ids=["blocking", "async"])
def test_a_nan_in_a_parameter_commits_nothing_and_raises(
    tmp_path: Path, events: Events, async_save: bool
) -> None:
    """Even with on_save_error="continue": a non-finite state is not a storage hiccup."""
    root = tmp_path / "ckpt"
    t = Trainee(0)
    mgr = manager(root, async_save=async_save, on_save_error="continue", keep_last=1)
    saved(mgr, t, 2)
    want = t.digest()
    with torch.no_grad():
        t.model[0].weight[1, 2] = float("nan")
    with pytest.raises(NumericalFaultError, match=r"step 4: .*rank\(s\) \[0\].*model\.0\.weight"):
        mgr.save(t.state(), 4)
        mgr.wait()  # an async save raises here
    mgr.close()
    assert sorted(p.name for p in root.iterdir()) == [step_dir(2)]  # not even a directory
    (ev,) = events("ckpt.save.nonfinite")
    assert (ev["step"], ev["ranks"], ev["tensors"], ev["nan"], ev["inf"]) == (4, [0], 1, 1, 0)
    assert ev["keys"] == ["rank 0: model.0.weight (1 NaN, 0 inf of 91)"]
    assert ev["newest_valid"] == 2
    assert events("ckpt.save.failed") == [] and events("ckpt.retention.delete") == []
    fresh = Trainee(1)
    assert manager(root).load_latest(fresh.state()) == 2  # still the newest valid
    assert fresh.digest() == want


def test_an_inf_in_optimizer_state_is_refused_too(tmp_path: Path, events: Events) -> None:
    t = Trainee(0)
    mgr = manager(tmp_path / "ckpt")
    t.train(1)
    t.opt.state[t.model[0].weight]["exp_avg_sq"][0, 0] = float("inf")
    with pytest.raises(NumericalFaultError, match=r"exp_avg_sq \(0 NaN, 1 inf"):
        mgr.save(t.state(), 1)
    assert not (tmp_path / "ckpt").exists()  # nothing was written, not even the location
    assert events("ckpt.save.nonfinite")[0]["keys"] == [
        "rank 0: optim.state.0.weight.exp_avg_sq (0 NaN, 1 inf of 91)"
    ]


# ---------------------------------------------------------------------- the manifest
def test_the_manifest_says_finite_and_an_older_one_without_it_still_loads(tmp_path: Path) -> None:
    t = Trainee(0)
    saved(manager(tmp_path), t, 3)
    path = tmp_path / step_dir(3) / "manifest.json"
    raw = json.loads(path.read_text())
    assert raw["finite"] is True and raw["format_version"] == 2
    assert manager(tmp_path).read_manifest(3).finite is True
    del raw["finite"]  # as written before the check existed
    path.write_text(json.dumps(raw))
    assert manager(tmp_path).read_manifest(3).finite is None
    fresh = Trainee(1)
    assert manager(tmp_path).load_latest(fresh.state()) == 3
    assert fresh.digest() == t.digest()
    raw["finite"] = "yes"
    with pytest.raises(CheckpointError, match="finite is 'yes'"):
        Manifest.from_json(json.dumps(raw).encode(), where="here")


# ---------------------------------------------------------------------- retention
def test_retention_keeps_the_newest_checkpoint_before_the_first_fault_across_restarts(
    tmp_path: Path, events: Events
) -> None:
    root = tmp_path / "ckpt"
    t = Trainee(0)
    mgr = manager(root, keep_last=1)
    for step in (2, 4):
        saved(mgr, t, step)
    assert mgr.note_numerical_fault(5, loss="nan", rank=1) == 5
    for step in (6, 8, 10):
        saved(mgr, t, step)
        assert committed_steps(root) == [4, step]
    mgr.close()
    (kept,) = events("ckpt.retention.keep_good")  # said once, not at every save
    assert (kept["step"], kept["first_fault"]) == (4, 5)
    (noted,) = events("ckpt.numerical_fault.noted")
    assert noted["first_fault"] == 5 and noted["details"] == {"loss": "nan", "rank": 1}

    again = manager(root, keep_last=1, async_save=True)  # a restart reads the record
    saved(again, t, 12)
    assert committed_steps(root) == [4, 12]
    assert again.note_numerical_fault(11) == 5  # appended; the first fault stays first
    saved(again, t, 14)
    again.close()
    assert committed_steps(root) == [4, 14]
    faults = read_faults(again.storage)
    assert [(f["step"], f["details"]) for f in faults] == [
        (5, {"loss": "nan", "rank": 1}),
        (11, {}),
    ]


@pytest.mark.parametrize(
    "content",
    [b'{"faults": [tru', b'{"kind": "something else", "faults": []}', b"[1, 2]"],
    ids=["torn", "foreign", "not-an-object"],
)
def test_an_unreadable_faults_record_is_an_error_never_overwritten(
    tmp_path: Path, events: Events, content: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    t = Trainee(0)
    mgr = manager(root, keep_last=1)
    saved(mgr, t, 2)
    (root / FAULTS_NAME).write_bytes(content)
    where = f"{root / FAULTS_NAME}: unreadable record"
    with pytest.raises(CheckpointError, match=re.escape(where)):
        mgr.note_numerical_fault(3)
    assert (root / FAULTS_NAME).read_bytes() == content
    saved(mgr, t, 4)  # committed; retention deletes nothing while it cannot read the record
    assert committed_steps(root) == [2, 4]
    (failed,) = events("ckpt.retention.failed")
    assert FAULTS_NAME in failed["error"]
    assert cli_main(["ls", str(root)]) == 2
    assert where in capsys.readouterr().err


def test_two_tiers_record_the_fault_in_both(tmp_path: Path) -> None:
    remote, local = tmp_path / "remote", tmp_path / "local"
    cfg = CheckpointConfig(url=str(remote), local_url=str(local), async_save=False, keep_last=1)
    tiers = TieredCheckpointManager(cfg)
    t = Trainee(0)
    tiers.save(t.state(), 2, tier="remote")
    tiers.save(t.state(), 3, tier="local")
    assert tiers.note_numerical_fault(4) == 4
    for step in (5, 6, 7, 8):
        tiers.save(t.state(), step, tier="remote" if step % 2 else "local")
    tiers.close()
    assert committed_steps(remote) == [2, 7] and committed_steps(local) == [3, 8]
    assert [f["step"] for f in json.loads((local / FAULTS_NAME).read_text())["faults"]] == [4]


# ---------------------------------------------------------------------- resilient ls
def test_ls_shows_good_after_fault_and_unknown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], forked_cli: ForkedCli
) -> None:
    root = tmp_path / "ckpt"
    t = Trainee(0)
    mgr = manager(root, keep_last=5)
    for step in (2, 4):
        saved(mgr, t, step)
    old = root / step_dir(2) / "manifest.json"
    old.write_text(
        json.dumps({k: v for k, v in json.loads(old.read_text()).items() if k != "finite"})
    )
    assert cli_main(["ls", str(root)]) == 0
    assert "numerical fault" not in capsys.readouterr().out  # none recorded: no footer
    mgr.note_numerical_fault(5)
    saved(mgr, t, 6)
    mgr.close()
    (root / step_dir(9)).mkdir()  # an unfinished save
    (out,) = forked_cli(["ls", str(root)])  # the command, in a process of its own
    assert out.returncode == 0, out.stderr
    header, *rows, footer = out.stdout.splitlines()
    assert header.split()[:6] == ["step", "state", "bytes", "world", "numeric", "written"]
    assert [r.split()[:2] + r.split()[4:-2] for r in rows] == [
        ["2", "committed", "?"],
        ["4", "committed", "good"],
        ["6", "committed", "after", "fault"],
        ["9", "unfinished"],
    ]
    assert footer == (
        "numerical fault first recorded at step 5: step 4 is the newest checkpoint before it, "
        "kept by retention"
    )


# ---------------------------------------------------------------------- several ranks
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_only_rank_1s_shard_is_nan_and_neither_rank_commits(
    tmp_path: Path, torchrun: Callable[..., Any]
) -> None:
    ckpt, out, run_dir = tmp_path / "ckpt", tmp_path / "out", tmp_path / "run"
    rc, stdout, stderr = torchrun(
        2, "nonfinite_worker.py", f"--ckpt={ckpt}", f"--out={out}", f"--run-dir={run_dir}",
        timeout=100,
    )  # fmt: skip
    assert rc == 0, stdout[-2000:] + stderr[-6000:]
    for rank in (0, 1):
        rec = json.loads((out / f"rank{rank}.json").read_text())
        assert rec["sharded"] == "DTensor" and rec["step1"] == 1
        for save in ("async", "blocking"):
            assert rec[save]["raised"] == "NumericalFaultError", (rank, save, rec[save])
            assert "rank(s) [1]" in rec[save]["message"]
        assert rec["candidates"] == [1] and rec["last_committed"] == 1
        seen = run_events(run_dir, "ckpt.save.nonfinite")
        mine = [e for e in seen if e["rank"] == rank]
        assert [(e["step"], e["ranks"]) for e in mine] == [(2, [1]), (3, [1])]
        assert mine[0]["keys"] == ["rank 1: model.0.weight (1 NaN, 0 inf of 39)"]
    assert sorted(p.name for p in ckpt.iterdir()) == [step_dir(1)]


# ---------------------------------------------------------------------- the supervisor
@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("hot", [False, True], ids=["cold", "hot"])
def test_run_stops_at_once_on_a_numerical_fault(
    tmp_path: Path, launcher: Launcher, hot: bool
) -> None:
    """Rank 0 exits 87 after init: no restart (cold), no hot replacement (--hot-recovery)."""
    code, err, run_dir, starts = run_rank0_exits(launcher, tmp_path, 87, hot=hot, timeout=80)
    assert code == ExitCode.NUMERICAL_FAULT, err[-3000:]
    assert starts == ["rank 0 attempt 0", "rank 1 attempt 0"]
    report = json.loads((run_dir / "supervisor_report.json").read_text())
    assert (report["outcome"], report["exit_code"]) == ("numerical fault", 87)
    assert [a["action"] for a in report["attempts"]] == ["stop: numerical fault"]
    assert "not restarted" in report["reason"]
    (stop,) = run_events(run_dir, "restart.numerical_fault")
    assert stop["ranks"] == [0] and stop["action"] == "stop"
    assert run_events(run_dir, "restart.decided") == []
    assert run_events(run_dir, "recovery.hot.replace") == []
    assert run_events(run_dir, "recovery.cold") == []
    assert "resilient run: numerical fault, exit code 87 (NUMERICAL_FAULT)" in err
