"""An Accelerate loop ported as a hand-written one (recipes/train_accelerate.py: Accelerator,
prepare, accumulate, backward; the loader tracked by the runtime instead of prepared): a kill -9
of rank 1 in the middle of a gradient accumulation, five steps after a checkpoint, ends with
the fault-free bits."""

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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_accelerate_loop_resumes_bit_for_bit(tmp_path: Path, launcher: Launcher) -> None:
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    code, _, err = launcher.run(_cmd(clean), timeout=140)
    assert code == ExitCode.OK, err[-4000:]
    code, _, err = launcher.run(_cmd(faulty, "kill@rank=1,step=25,phase=backward"), timeout=140)
    assert code == ExitCode.OK, err[-4000:]
    assert resumed_step(faulty / "run") in (10, 20), err[-4000:]
    digest = (clean / "digest.txt").read_text()
    assert digest.startswith("40 ") and (faulty / "digest.txt").read_text() == digest
