"""Load-time resharding across world sizes and wrappers, in real torchrun processes on gloo.

Four launches, chained so that each checkpoint is written once:
  A. 4 ranks, FSDP2: train 3 steps, save `c4`.
  B. 2 ranks: load `c4` as FSDP2 and as DDP; train and save `c2` as FSDP2.
  C. 1 plain process (no torchrun, no process group): load `c4`; train and save `c1`.
  D. 4 ranks, FSDP2: load `c2` and `c1`.
Every load must give the full model and AdamW state bit for bit (state_digest) and the
scheduler state of the save.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import Result, read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WORKER = "reshard_worker.py"
Records = dict[str, dict[str, Any]]


class Launch:
    """One worker launch: its records per op (rank 0's), checked equal on every rank."""

    def __init__(
        self, run: Callable[[list[str]], Result], nproc: int, ops: list[str], base: Path, name: str
    ) -> None:
        self.run_dir = base / f"run_{name}"
        out = base / f"out_{name}"
        rc, stdout, stderr = run(["--out", str(out), "--run-dir", str(self.run_dir), *ops])
        assert rc == 0, f"launch {name} failed (rc={rc})\n{stdout[-2000:]}\n{stderr[-8000:]}"
        per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
        for r, recs in enumerate(per_rank):  # state_digest is of the full state: rank-invariant
            assert [x["digest"] for x in recs] == [x["digest"] for x in per_rank[0]], r
        # "save:fsdp:/x/c4" -> "fsdp:c4"
        self.records: Records = {
            f"{rec['op'].split(':')[1]}:{Path(rec['op']).name}": rec for rec in per_rank[0]
        }

    def events(self, event: str) -> list[dict[str, Any]]:
        return read_events(self.run_dir / "logs" / "rank0.jsonl", event)


def _torchrun(torchrun: Callable[..., Result], nproc: int) -> Callable[[list[str]], Result]:
    return lambda args: torchrun(nproc, WORKER, *args, timeout=180)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reshard")


@pytest.fixture(scope="module")
def launch_a(base: Path, torchrun: Callable[..., Result]) -> Launch:
    return Launch(_torchrun(torchrun, 4), 4, [f"save:fsdp:{base / 'c4'}"], base, "a")


@pytest.fixture(scope="module")
def launch_b(base: Path, torchrun: Callable[..., Result], launch_a: Launch) -> Launch:
    c4, c2 = base / "c4", base / "c2"
    ops = [f"load:fsdp:{c4}", f"load:ddp:{c4}", f"save:fsdp:{c2}"]
    return Launch(_torchrun(torchrun, 2), 2, ops, base, "b")


@pytest.fixture(scope="module")
def launch_c(base: Path, python_proc: Callable[..., Result], launch_a: Launch) -> Launch:
    ops = [f"load:plain:{base / 'c4'}", f"save:plain:{base / 'c1'}"]
    return Launch(lambda args: python_proc(WORKER, *args, timeout=120), 1, ops, base, "c")


@pytest.fixture(scope="module")
def launch_d(
    base: Path, torchrun: Callable[..., Result], launch_b: Launch, launch_c: Launch
) -> Launch:
    ops = [f"load:fsdp:{base / 'c2'}", f"load:fsdp:{base / 'c1'}"]
    return Launch(_torchrun(torchrun, 4), 4, ops, base, "d")


# (saving launch, its op key, ranks) -> (loading launch, its op key, ranks)
CASES = {
    "4fsdp-to-2fsdp": (("launch_a", "fsdp:c4", 4), ("launch_b", "fsdp:c4", 2)),
    "4fsdp-to-2ddp": (("launch_a", "fsdp:c4", 4), ("launch_b", "ddp:c4", 2)),
    "4fsdp-to-1plain": (("launch_a", "fsdp:c4", 4), ("launch_c", "plain:c4", 1)),
    "2fsdp-to-4fsdp": (("launch_b", "fsdp:c2", 2), ("launch_d", "fsdp:c2", 4)),
    "1plain-to-4fsdp": (("launch_c", "plain:c1", 1), ("launch_d", "fsdp:c1", 4)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reshard_is_bitwise_exact(request: pytest.FixtureRequest, base: Path, case: str) -> None:
    (save_fx, save_key, save_world), (load_fx, load_key, load_world) = CASES[case]
    saver: Launch = request.getfixturevalue(save_fx)
    loader: Launch = request.getfixturevalue(load_fx)
    saved = saver.records[save_key]
    loaded = loader.records[load_key]

    assert saved["op"].startswith("save:") and loaded["op"].startswith("load:")
    assert (saved["world_size"], loaded["world_size"]) == (save_world, load_world)
    assert saved["step"] == loaded["step"] == 3
    assert loaded["digest_before"] != saved["digest"]  # the loader started from other weights
    assert loaded["digest"] == saved["digest"]
    assert loaded["scheduler"] == saved["scheduler"]
    assert loaded["lr"] == saved["lr"] == 0.005

    # The checkpoint is sharded as saved: one data file per saving rank, in the manifest.
    ckpt = base / save_key.split(":")[1] / "step_000000003"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == save_world
    assert {*manifest["files"], "manifest.json"} == {p.name for p in ckpt.iterdir()}
    assert len(list(ckpt.glob("*.distcp"))) == save_world

    reshard = [e for e in loader.events("ckpt.load.reshard") if e["saved_world_size"] == save_world]
    assert reshard and reshard[0]["world_size"] == load_world
    assert loader.events("ckpt.fallback") == []


def test_a_file_only_another_rank_checks_fails_the_load_on_every_rank_untouched(
    base: Path, torchrun: Callable[..., Result], launch_b: Launch
) -> None:
    """Single-pass verification: rank 1 checks its own file (rank 0 never reads it). A flipped
    byte there makes both ranks fall back, before either copies a byte into a tensor."""
    import shutil

    bad = base / "c2_bad"
    shutil.copytree(base / "c2", bad)
    data = bad / "step_000000003" / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))

    launch = Launch(_torchrun(torchrun, 2), 2, [f"load:fsdp:{bad}"], base, "bad")
    rec = launch.records["fsdp:c2_bad"]
    assert rec["step"] is None  # the only checkpoint failed: a fresh start
    assert rec["digest"] == rec["digest_before"]  # every rank's state untouched
    (fallback,) = launch.events("ckpt.fallback")
    assert fallback["reason"] == "verification failed"
    assert any("__1_0.distcp" in p and "corrupt" in p for p in fallback["problems"])
    assert launch.events("ckpt.load") == []
