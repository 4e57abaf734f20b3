"""An Accelerate loop ported as a hand-written one (recipes/train_accelerate.py: Accelerator,
prepare, accumulate, backward; the loader tracked by the runtime instead of prepared): a kill -9
of rank 1 in the middle of a gradient accumulation, five steps after a checkpoint, ends with
the fault-free bits, cold and under --hot-recovery."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import REPO_ROOT, Launcher, forks_preloading, recipe_cmd, resumed_step

from resilient.exitcodes import ExitCode

pytest.importorskip("accelerate")


_framework_in_forks = forks_preloading(  # the ranks fork with the framework imported
    "accelerate",
    "transformers.models.gpt2.modeling_gpt2",
)


RECIPE = str(REPO_ROOT / "recipes" / "train_accelerate.py")


def _cmd(tmp: Path, *faults: str) -> list[str]:
    return recipe_cmd(RECIPE, tmp, faults=faults)


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory, launcher: Launcher) -> str:
    clean = tmp_path_factory.mktemp("accelerate_fault_free")
    code, _, err = launcher.run(_cmd(clean), timeout=140)
    assert code == ExitCode.OK, err[-4000:]
    digest = (clean / "digest.txt").read_text()
    assert digest.startswith("40 ")
    return digest


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_accelerate_loop_resumes_bit_for_bit(
    tmp_path: Path, launcher: Launcher, fault_free: str
) -> None:
    code, _, err = launcher.run(_cmd(tmp_path, "kill@rank=1,step=25,phase=backward"), timeout=140)
    assert code == ExitCode.OK, err[-4000:]
    assert resumed_step(tmp_path / "run") in (10, 20), err[-4000:]
    assert (tmp_path / "digest.txt").read_text() == fault_free


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hot_recovery_of_an_accelerate_loop_forms_and_ends_bit_for_bit(
    tmp_path: Path, launcher: Launcher, fault_free: str
) -> None:
    """The survivor runs the script again in its process, where Accelerate's singletons still
    say that the process group is made: unless the runtime empties them
    (hot/framework_state.py), its Accelerator() skips init_process_group, the replacement's
    waits for it, and both wait out the roll call's start-up timeout."""
    code, _, err = launcher.run(
        recipe_cmd(
            RECIPE, tmp_path, "--hot-recovery", faults=("kill@rank=1,step=25,phase=backward",)
        ),
        timeout=140,
    )
    assert code == ExitCode.OK, err[-4000:]
    assert "recovery.hot.framework_reset" in err
    assert "recovery.hot.formed" in err, err[-4000:]
    assert (tmp_path / "digest.txt").read_text() == fault_free
