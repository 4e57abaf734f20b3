"""`resilient ls` and `resilient verify` on real checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState
from resilient.cli import main


@pytest.fixture
def ckpt_root(tmp_path: Path) -> Path:
    model = torch.nn.Linear(4, 3)
    mgr = CheckpointManager(CheckpointConfig(url=str(tmp_path), async_save=False))
    for step in (2, 4):
        mgr.save(TrainState(model=model), step)
    mgr.close()
    (tmp_path / "step_000000006").mkdir()  # an unfinished save
    return tmp_path


def test_ls_lists_committed_and_unfinished(ckpt_root: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["ls", str(ckpt_root)]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [ln.split()[:2] for ln in lines] == [
        ["2", "committed"],
        ["4", "committed"],
        ["6", "unfinished"],
    ]


def test_verify_ok_then_detects_a_flipped_byte(ckpt_root: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["verify", str(ckpt_root)]) == 0
    assert "step 4: OK" in capsys.readouterr().out
    data = ckpt_root / "step_000000004" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    assert main(["verify", str(ckpt_root)]) == 1
    out = capsys.readouterr().out
    assert "INVALID" in out and "__0_0.distcp: crc32" in out
    assert main(["verify", str(ckpt_root), "--step", "2"]) == 0


def test_verify_empty_location_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert "nothing at this location" in capsys.readouterr().err
