"""The Hugging Face Trainer under the runtime (resilient/integrations/hf.py), against the
framework itself: recipes/train_hf.py is a stock Trainer script (a tiny GPT-2 built from a
config, two loader workers, a random augmentation in __getitem__) whose only change is the
import of the Trainer. Under `resilient run` on 2 CPU ranks, each fault ends with the bits of
an uninterrupted run; bad options are refused before step 0 with the fix."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO_ROOT,
    Launcher,
    forks_preloading,
    latest_event,
    recipe_cmd,
    resumed_step,
    run_cmd,
    start,
    wait_for,
)

from resilient.data.worker_start import fork_deadlock_prone
from resilient.exitcodes import ExitCode

transformers = pytest.importorskip("transformers")


_framework_in_forks = forks_preloading(  # the ranks fork with the framework imported
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.trainer",
    "transformers.training_args",
    "resilient.integrations.hf",
)


RECIPE = str(REPO_ROOT / "recipes" / "train_hf.py")


def _run(tmp: Path, *extra: str, faults: tuple[str, ...] = (), script: tuple[str, ...] = ()):
    # exact with gradient accumulation too
    return recipe_cmd(RECIPE, tmp, *extra, faults=faults, script=("--grad-accum=2", *script))


def _digest(out: Path) -> str:
    return (out / "digest.txt").read_text().strip()


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory, launcher: Launcher) -> str:
    out = tmp_path_factory.mktemp("hf_fault_free")
    code, _, err = launcher.run(_run(out), timeout=150)
    assert code == ExitCode.OK, err[-4000:]
    digest = _digest(out)
    assert digest.startswith("60 ")
    return digest


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_9_resumes_bit_for_bit(tmp_path: Path, launcher: Launcher, fault_free: str) -> None:
    """Rank 1 SIGKILLed in the backward of step 35 (loader workers running), with a save
    every 16 steps, an epoch's length: the restart resumes from the save at the end of epoch
    2, step 32 (or of epoch 1, when that save had not committed yet), and ends equal. Such a
    resume once died of StopIteration in every attempt: the loader resumed the finished
    epoch, an empty one, where the Trainer began the next."""
    code, _, err = launcher.run(
        _run(tmp_path, faults=("kill@rank=1,step=35,phase=backward",), script=("--save-steps=16",)),
        timeout=200,
    )
    assert code == ExitCode.OK, err[-4000:]
    assert resumed_step(tmp_path / "run") in (16, 32), err[-4000:]
    assert _digest(tmp_path) == fault_free


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not fork_deadlock_prone(), reason="this interpreter has CPython's fix")
def test_a_loader_worker_stuck_in_its_fork_restarts_bit_for_bit(
    tmp_path: Path, launcher: Launcher, fault_free: str
) -> None:
    """Rank 1's first loader worker of epoch 2 (step 32: 16 steps an epoch) never starts, as
    on CPython before 3.11.10 (resilient/data/worker_start.py): it is named in seconds, not
    at the phase's timeout, the run restarts from step 20 and ends equal."""
    code, _, err = launcher.run(
        _run(tmp_path, faults=("fork_stall@rank=1,step=32,phase=data",)),
        timeout=200,
        env={"RESILIENT_WATCHDOG": json.dumps({"worker_start_timeout_s": 3.0})},
    )
    assert code == ExitCode.OK, err[-4000:]
    hang = latest_event(tmp_path / "run", "hang.detected")
    assert hang is not None and hang["ranks"] == [1], err[-4000:]
    (named,) = hang["named"]
    assert (named["step"], named["phase"], named["timeout_kind"]) == (32, "data", "worker_start")
    assert 3.0 <= named["progress_age_s"] < 10.0, named
    assert resumed_step(tmp_path / "run") == 20
    assert _digest(tmp_path) == fault_free


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hot_recovery_replaces_the_lost_rank_in_place(
    tmp_path: Path, launcher: Launcher, fault_free: str
) -> None:
    """With --hot-recovery the survivor re-runs the script in place and a spare takes rank
    1's place: Accelerate's own init_process_group forms on a fresh store for the generation
    (hot/script_store.py), the state comes from the in-memory snapshots, and it ends equal."""
    code, _, err = launcher.run(
        _run(tmp_path, "--hot-recovery", faults=("kill@rank=1,step=27,phase=backward",)),
        timeout=200,
    )
    assert code == ExitCode.OK, err[-4000:]
    # (under a heavy load a later step may still fall back cold; the bits hold either way)
    assert "recovery.hot.formed" in err and "hot=True" in err
    assert _digest(tmp_path) == fault_free


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_stops_at_an_agreed_step_and_loses_nothing(
    tmp_path: Path, launcher: Launcher, fault_free: str
) -> None:
    """SIGTERM to the launcher after the first checkpoint: every rank stops at one step with
    its checkpoint committed (exit 85); launched again, the run ends equal."""
    slow = ("slow@phase=forward,seconds=0.05",)  # long enough to signal mid-run
    with start(_run(tmp_path, "--grace-period=30", faults=slow), tmp_path / "first.log") as run:
        wait_for(
            lambda: (tmp_path / "ckpt" / "step_000000020").is_dir(), timeout=120, what="step 20"
        )
        os.kill(run.proc.pid, signal.SIGTERM)
        assert run.wait(timeout=60) == ExitCode.PREEMPTED, run.output()[-4000:]
        assert "preempt.committed" in run.output()
    code, _, err = launcher.run(_run(tmp_path), timeout=150)
    assert code == ExitCode.OK, err[-4000:]
    assert _digest(tmp_path) == fault_free


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_nan_that_comes_back_stops_with_87(tmp_path: Path, launcher: Launcher) -> None:
    """A batch that is NaN whenever it is seen: the restart meets it again, and the run stops
    as a numerical fault (exit 87) instead of training on, or restarting forever."""
    bad = ("bad_batch@rank=1,step=25,phase=forward",)
    code, _, err = launcher.run(_run(tmp_path, faults=bad), timeout=200)
    assert code == ExitCode.NUMERICAL_FAULT, err[-4000:]
    assert "numeric.fault" in err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_resume_on_fewer_ranks_runs_every_step_with_the_global_batch_said(
    tmp_path: Path, launcher: Launcher
) -> None:
    """Stopped at step 30 on 2 ranks, resumed on 1: the Trainer keeps its per-device batch, so
    the global batch follows the world (one event, old and new), the loader continues at the
    30th step's samples, and the run still ends at max_steps (the Trainer's epoch count,
    computed for a fresh start on 1 rank, would have ended its loop at step 34)."""
    first = run_cmd(
        "--nproc-per-node=2",
        f"--run-dir={tmp_path / 'run'}",
        f"--checkpoint-url={tmp_path / 'ckpt'}",
        RECIPE,
        f"--out={tmp_path}",
    )
    code, _, err = launcher.run(first, timeout=150, env={"RESILIENT_STOP_AT": "30"})
    assert code == ExitCode.OK, err[-4000:]
    second = [a if a != "--nproc-per-node=2" else "--nproc-per-node=1" for a in first]
    code, _, err = launcher.run(second, timeout=150)
    assert code == ExitCode.OK, err[-4000:]
    assert "data.global_batch_changed" in err and "saved=8" in err and "now=4" in err
    assert "data.reshard" in err and "consumed=240" in err
    assert _digest(tmp_path).startswith("60 ")


@pytest.mark.slow
@pytest.mark.extended  # `make soak`: the kill, hot, SIGTERM and NaN-persists cases run in CI
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "fault",
    [
        "nan@rank=1,step=25,phase=forward",  # once: a cold restart, then it does not come back
        "hang@rank=1,step=25,phase=forward",  # named after the 4 s timeout below, restarted
        "oom@rank=1,step=25,phase=forward",  # one rank's OOM takes both down at once
    ],
)
def test_a_fault_once_ends_bit_for_bit(
    tmp_path: Path, launcher: Launcher, fault_free: str, fault: str
) -> None:
    watchdog = '{"timeout_s": 4, "heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 3}'
    code, _, err = launcher.run(
        _run(tmp_path, faults=(fault,)),
        timeout=250,
        env={"RESILIENT_WATCHDOG": watchdog},
    )
    assert code == ExitCode.OK, err[-4000:]
    assert "from_checkpoint=True" in err
    assert _digest(tmp_path) == fault_free


@pytest.mark.timeout(300)
def test_a_run_resumed_with_another_max_steps_is_refused_with_the_saved_one(
    tmp_path: Path, launcher: Launcher
) -> None:
    """The scheduler was built for the saved length: another max_steps is refused before
    step 0 (exit 80), naming the saved value, and the checkpoint stays as it was."""
    code, _, err = launcher.run(_run(tmp_path, script=("--steps=20",)), timeout=150)
    assert code == ExitCode.OK, err[-4000:]
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    code, _, err = launcher.run(_run(tmp_path, script=("--steps=30",)), timeout=150)
    assert code == ExitCode.MISMATCH, err[-4000:]
    assert "saved with 20 steps in all and now counts 30" in err
    assert "resume with max_steps=20" in err
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == saved


# ---------------------------------------------------------------------- bad input, 1 process
class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.full((8,), i)
        return {"input_ids": ids, "labels": ids}


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(_Tokens()[i] for i in range(8))


def _trainer(tmp_path: Path, dataset: object = None, cls: type | None = None, **args: object):
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from resilient.integrations.hf import Trainer

    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1))
    targs = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, use_cpu=True, report_to=[], **args
    )
    return (cls or Trainer)(
        model=model,
        args=targs,
        train_dataset=dataset if dataset is not None else _Tokens(),
        resilient_options={"checkpoint_dir": str(tmp_path / "ckpt"), "run_dir": str(tmp_path)},
    )


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("single_process")
def test_options_that_defeat_an_exact_resume_are_refused_with_the_fix(tmp_path: Path) -> None:
    from resilient.errors import ConfigError
    from resilient.integrations.hf import Trainer

    with pytest.raises(ConfigError, match="auto_find_batch_size"):
        _trainer(tmp_path, auto_find_batch_size=True)
    with pytest.raises(ConfigError, match="IterableDataset without state_dict"):
        _trainer(tmp_path, dataset=_Stream())

    class OwnSampler(Trainer):
        def _get_train_sampler(self, train_dataset=None):  # type: ignore[no-untyped-def]
            return None

    with pytest.raises(ConfigError, match=r"overrides Trainer\._get_train_sampler"):
        _trainer(tmp_path, cls=OwnSampler)
    trainer = _trainer(tmp_path)
    with pytest.raises(ConfigError, match="init_from"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-100"))
    trainer.rt.close()


@pytest.mark.timeout(60)
def test_an_untested_transformers_release_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient.errors import ConfigError
    from resilient.integrations import _hf_parts

    monkeypatch.setattr(_hf_parts.transformers, "__version__", "4.57.1")
    with pytest.raises(ConfigError, match=r"tested with transformers >=5.3,<6.0"):
        _hf_parts.check_transformers()
    # a pre-release of a tested minor is allowed
    monkeypatch.setattr(_hf_parts.transformers, "__version__", "5.30.0.dev0")
    _hf_parts.check_transformers()
