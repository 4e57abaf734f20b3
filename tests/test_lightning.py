"""Lightning under the runtime (resilient/integrations/lightning.py), against the framework
itself: recipes/train_lightning.py is a stock Lightning script (a tiny GPT-2 built from a
config, two loader workers, a random augmentation in __getitem__, ModelCheckpoint, a CSV
logger, validation each epoch) whose only change is the Resilient callback. Under `resilient
run` on 2 CPU ranks, each fault ends with the bits (and Lightning's counters) of an
uninterrupted run; options that defeat an exact resume are refused before step 0 with the fix."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT, Launcher, forks_preloading, recipe_cmd, resumed_step, start, wait_for

from resilient.exitcodes import ExitCode

pl = pytest.importorskip("lightning.pytorch")


_framework_in_forks = forks_preloading(  # the ranks fork with the framework imported
    "lightning.pytorch",
    "lightning.pytorch.strategies",
    "transformers.models.gpt2.modeling_gpt2",
    "resilient.integrations.lightning",
)


RECIPE = str(REPO_ROOT / "recipes" / "train_lightning.py")


def _run(tmp: Path, *extra: str, faults: tuple[str, ...] = (), script: tuple[str, ...] = ()):
    # exact with gradient accumulation too: 16 steps an epoch
    return recipe_cmd(RECIPE, tmp, *extra, faults=faults, script=("--grad-accum=2", *script))


def _final(out: Path) -> tuple[str, str]:
    """(the step and digest of the weights and optimizer, Lightning's counters)."""
    return (out / "digest.txt").read_text().strip(), (out / "lightning.txt").read_text().strip()


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory, launcher: Launcher) -> tuple[str, str]:
    out = tmp_path_factory.mktemp("pl_fault_free")
    code, _, err = launcher.run(_run(out), timeout=200)
    assert code == ExitCode.OK, err[-4000:]
    final = _final(out)
    assert final[0].startswith("60 ")
    assert final[1] == "global_step=60 epoch=4 batches_that_stepped=60"
    return final


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_9_mid_epoch_resumes_bit_for_bit(
    tmp_path: Path, launcher: Launcher, fault_free: tuple[str, str]
) -> None:
    """Rank 1 SIGKILLed in the backward of step 27 (epoch 1, between two checkpoints, loader
    workers running): the restart resumes at step 20, 8 batches into epoch 1 (or at step 10,
    20 batches into epoch 0, when the step-20 save had not committed yet), replays no batch
    to get there, and ends equal, Lightning's counters included."""
    code, _, err = launcher.run(
        _run(tmp_path, faults=("kill@rank=1,step=27,phase=backward",)), timeout=250
    )
    assert code == ExitCode.OK, err[-4000:]
    step = resumed_step(tmp_path / "run")
    assert step in (10, 20), err[-4000:]
    assert "lightning.resumed" in err
    assert ("batch=8 epoch=1" if step == 20 else "batch=20 epoch=0") in err
    assert _final(tmp_path) == fault_free
    # Lightning's ModelCheckpoint and logger kept working: its files, and the resumed
    # attempt's log of the steps after the resume
    assert (tmp_path / "lightning-ckpt" / "last.ckpt").is_file()
    assert (tmp_path / "logs" / "version_1" / "metrics.csv").is_file()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hot_recovery_replaces_the_lost_rank_in_place(
    tmp_path: Path, launcher: Launcher, fault_free: tuple[str, str]
) -> None:
    """With --hot-recovery the survivor re-runs the script in place and a spare takes rank
    1's place: Lightning's own init_process_group forms on a fresh store for the generation,
    the state (Lightning's loops included) comes from the in-memory snapshots, and it ends
    equal. The snapshot it lands on is step 32's, the last step of epoch 1: between that step
    and the next, Lightning validates (its loader draws from the RNG) and starts epoch 2. A
    snapshot taken before that, as one once was, resumed with the RNG one draw behind."""
    snapshots = '{"enabled": true, "every_steps": 16}'
    code, _, err = launcher.run(
        _run(tmp_path, "--hot-recovery", faults=("kill@rank=1,step=35,phase=backward",)),
        timeout=250,
        env={"RESILIENT_SNAPSHOT": snapshots},
    )
    assert code == ExitCode.OK, err[-4000:]
    # (under a heavy load a later step may still fall back cold; the bits hold either way)
    assert "recovery.hot.formed" in err and "hot=True" in err
    assert "to_step=32" in err, err[-4000:]
    assert "resume.diverged" not in err, err[-4000:]
    assert _final(tmp_path) == fault_free


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fsdp2_kill_9_resumes_bit_for_bit(tmp_path: Path, launcher: Launcher) -> None:
    """FSDP2 through Lightning's ModelParallelStrategy (fully_shard in configure_model), each
    rank holding half of every parameter: killed as above, the run ends with the bits of an
    uninterrupted FSDP2 run."""
    code, _, err = launcher.run(_run(tmp_path / "clean", script=("--fsdp",)), timeout=200)
    assert code == ExitCode.OK, err[-4000:]
    faulty = tmp_path / "faulty"
    code, _, err = launcher.run(
        _run(faulty, faults=("kill@rank=1,step=27,phase=backward",), script=("--fsdp",)),
        timeout=200,
    )
    assert code == ExitCode.OK, err[-4000:]
    assert "mesh.layout" in err and "lightning.resumed" in err
    step = resumed_step(faulty / "run")
    assert ("batch=8 epoch=1" if step == 20 else "batch=20 epoch=0") in err, err[-4000:]
    assert _final(faulty) == _final(tmp_path / "clean")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_stops_at_an_agreed_step_and_loses_nothing(
    tmp_path: Path, launcher: Launcher, fault_free: tuple[str, str]
) -> None:
    """SIGTERM to the launcher after the first checkpoint: every rank stops at one step with
    its checkpoint committed (exit 85), saved outside the signal handler; launched again, the
    run ends equal."""
    slow = ("slow@phase=forward,seconds=0.05",)  # long enough to signal mid-run
    with start(_run(tmp_path, "--grace-period=30", faults=slow), tmp_path / "first.log") as run:
        wait_for(
            lambda: (tmp_path / "ckpt" / "step_000000020").is_dir(), timeout=150, what="step 20"
        )
        os.kill(run.proc.pid, signal.SIGTERM)
        assert run.wait(timeout=60) == ExitCode.PREEMPTED, run.output()[-4000:]
        assert "preempt.committed" in run.output()
    code, _, err = launcher.run(_run(tmp_path), timeout=200)
    assert code == ExitCode.OK, err[-4000:]
    assert _final(tmp_path) == fault_free


@pytest.mark.extended  # `make soak`: kill, hot, FSDP2 and SIGTERM run in CI
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hang_is_named_and_the_restart_ends_bit_for_bit(
    tmp_path: Path, launcher: Launcher, fault_free: tuple[str, str]
) -> None:
    """Rank 1 stops making progress in the forward of step 25, inside Lightning's loop: the
    watchdog names it (rank, step, phase) after its 15 s phase timeout, every rank leaves
    with exit 81 at once, and the restart from step 20 ends equal."""
    env = {**os.environ, "RESILIENT_WATCHDOG": '{"timeout_s": 15}'}
    code, _, err = launcher.run(
        _run(tmp_path, faults=("hang@rank=1,step=25,phase=forward",)), timeout=250, env=env
    )
    assert code == ExitCode.OK, err[-4000:]
    assert "hang.detected" in err and "'rank': 1, 'step': 25, 'phase': 'forward'" in err
    assert _final(tmp_path) == fault_free


@pytest.mark.extended  # `make soak`: kill, hot, FSDP2 and SIGTERM run in CI
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_nan_once_restarts_and_ends_bit_for_bit(
    tmp_path: Path, launcher: Launcher, fault_free: tuple[str, str]
) -> None:
    """A NaN loss on rank 1 in the first micro-batch of step 25: every rank sees it before
    the update (the gradients are checked after Lightning's closure), the step changes
    nothing, the run restarts from step 20, and the replay without the fault ends equal."""
    code, _, err = launcher.run(
        _run(tmp_path, faults=("nan@rank=1,step=25,phase=forward",)), timeout=250
    )
    assert code == ExitCode.OK, err[-4000:]
    assert "numeric.fault" in err and "action=restart" in err
    assert _final(tmp_path) == fault_free


@pytest.mark.extended  # `make soak`, for CI's budget: the Trainer's twin runs in CI
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_nan_that_comes_back_stops_with_87(tmp_path: Path, launcher: Launcher) -> None:
    """A batch that is NaN whenever it is seen: the restart meets it again, and the run stops
    as a numerical fault (exit 87) instead of training on, or restarting forever."""
    bad = ("bad_batch@rank=1,step=25,phase=forward",)
    code, _, err = launcher.run(_run(tmp_path, faults=bad), timeout=250)
    assert code == ExitCode.NUMERICAL_FAULT, err[-4000:]
    assert "numeric.fault" in err


# ---------------------------------------------------------------------- bad input, 1 process
class _Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i))


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(_Rows()[i] for i in range(8))


class _OwnSampler(torch.utils.data.Sampler):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(8))

    def __len__(self) -> int:
        return 8


def _module(loader: torch.utils.data.DataLoader) -> object:
    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(x).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return loader

    return Tiny()


def _fit(tmp_path: Path, loader: torch.utils.data.DataLoader, **fit: object) -> None:
    from resilient.integrations.lightning import Resilient

    callback = Resilient(checkpoint_dir=str(tmp_path / "ckpt"), run_dir=str(tmp_path))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    try:
        trainer.fit(_module(loader), **fit)  # type: ignore[arg-type]
    finally:
        if callback.rt is not None:
            callback.rt.close()


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("single_process")
def test_options_that_defeat_an_exact_resume_are_refused_with_the_fix(tmp_path: Path) -> None:
    from resilient.errors import ConfigError

    DataLoader = torch.utils.data.DataLoader
    with pytest.raises(ConfigError, match="IterableDataset without state_dict"):
        _fit(tmp_path / "a", DataLoader(_Stream(), batch_size=2))
    with pytest.raises(ConfigError, match=r"sampler of its own \(_OwnSampler\)"):
        _fit(tmp_path / "b", DataLoader(_Rows(), batch_size=2, sampler=_OwnSampler()))
    # a stock script's resume from Lightning's own checkpoint
    ckpt = tmp_path / "last.ckpt"
    weights = _module(DataLoader(_Rows())).state_dict()  # type: ignore[attr-defined]
    torch.save({"state_dict": weights, "pytorch-lightning_version": pl.__version__}, ckpt)
    with pytest.raises(ConfigError, match="Drop ckpt_path"):
        _fit(tmp_path / "c", DataLoader(_Rows(), batch_size=2), ckpt_path=str(ckpt))
    # and a stock one goes through: 2 steps, resumable
    _fit(tmp_path / "d", DataLoader(_Rows(), batch_size=2, shuffle=True))
    assert (tmp_path / "d" / "ckpt" / "step_000000002").is_dir()


@pytest.mark.timeout(60)
def test_an_untested_lightning_release_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient.errors import ConfigError
    from resilient.integrations import _lightning_parts

    monkeypatch.setattr(_lightning_parts.lightning, "__version__", "2.4.0")
    with pytest.raises(ConfigError, match=r"tested with lightning >=2.5,<3.0"):
        _lightning_parts.check_lightning()
    monkeypatch.setattr(_lightning_parts.lightning, "__version__", "3.0.0")
    with pytest.raises(ConfigError, match=r"install a tested release"):
        _lightning_parts.check_lightning()
    monkeypatch.setattr(_lightning_parts.lightning, "__version__", "2.7.0.dev0")
    _lightning_parts.check_lightning()


@pytest.mark.timeout(60)
def test_strategies_that_step_their_own_way_are_refused() -> None:
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy

    from resilient.errors import ConfigError
    from resilient.integrations import _lightning_parts

    deepspeed_like = type("DeepSpeedStrategy", (DDPStrategy,), {})()
    options = {"reload_dataloaders_every_n_epochs": 0, "overfit_batches": 0}
    with pytest.raises(ConfigError, match=r"DeepSpeedStrategy is not supported.*strategy='ddp'"):
        _lightning_parts.check_trainer(SimpleNamespace(strategy=deepspeed_like, **options))
    _lightning_parts.check_trainer(SimpleNamespace(strategy=DDPStrategy(), **options))
    with pytest.raises(ConfigError, match="reload_dataloaders_every_n_epochs"):
        _lightning_parts.check_trainer(
            SimpleNamespace(
                strategy=DDPStrategy(), **{**options, "reload_dataloaders_every_n_epochs": 1}
            )
        )
