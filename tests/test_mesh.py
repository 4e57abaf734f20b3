"""2-D meshes (resilient/mesh/): the data-parallel degree, not the world size, counts data.

Real `resilient run` launches of tests/workers/mesh_train.py on gloo: FSDP2 over the
data-parallel dimensions and tensor parallel over "tp". One 4-rank run (dp=2 x tp=2) stops
with a checkpoint at step 4; two resumes on 2 ranks change its mesh:
- dp=2 x tp=1: the tp degree changed, the dp degree did not, so no accumulation (the bug
  this fixes: it said 2) and the exact samples;
- dp=1 x tp=2: the dp degree halved, so two micro-batches per step keep the global batch,
  and the exact samples.
The pure rules (the sampler check, the global batch) run in milliseconds below.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import Launcher, last_by_step, records, run_cmd, run_events
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from recipes.common.data import build_dataset
from resilient.data.batches import ResumableBatches
from resilient.data.position import DataPosition
from resilient.errors import ConfigError
from resilient.mesh import MeshLayout

WORKER = "tests/workers/mesh_train.py"
BATCH = 4


def _dataset() -> Any:
    return build_dataset(block_size=16, num_chars=40_000, seed=0)[0]  # as the worker's


def _order(n: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()


def _mesh(dp_rep: int, dp_shard: int, tp: int) -> MeshLayout:
    world = dp_rep * dp_shard * tp
    return MeshLayout.build(
        ("dp_replicate", "dp_shard", "tp"), (dp_rep, dp_shard, tp), range(world), world_size=world
    )


def _batches(replicas: int, rank: int) -> ResumableBatches:
    ds = _dataset()
    sampler = StatefulDistributedSampler(
        ds, num_replicas=replicas, rank=rank, shuffle=True, seed=0, drop_last=True
    )
    return ResumableBatches(StatefulDataLoader(ds, batch_size=BATCH, sampler=sampler))


# ---------------------------------------------------------------------- bad input, pure
@pytest.mark.timeout(30)
def test_a_sampler_sized_by_the_world_under_tp_is_refused_before_step_0() -> None:
    mesh = _mesh(1, 2, 2)
    with pytest.raises(ConfigError, match=r"over the world .* data-parallel degree 2.*\[2\]"):
        DataPosition(_batches(4, 3), layout=mesh, rank=3, global_batch_size=None)
    with pytest.raises(ConfigError, match="coordinate is 1"):
        DataPosition(_batches(2, 0), layout=mesh, rank=3, global_batch_size=None)
    ok = DataPosition(_batches(2, 1), layout=mesh, rank=3, global_batch_size=None)
    assert (ok.global_batch, ok.grad_accum) == (2 * BATCH, 1)  # x dp degree, not x world


@pytest.mark.timeout(30)
def test_a_global_batch_the_dp_degree_cannot_split_is_kept_in_smaller_micro_batches() -> None:
    mesh = _mesh(1, 2, 2)  # the dp degree counts, not the world: 6 samples a dp rank
    odd = DataPosition(_batches(2, 0), layout=mesh, rank=0, global_batch_size=12)
    assert (odd.micro, odd.grad_accum, odd.effective_batch) == (3, 2, 12)
    pos = DataPosition(_batches(2, 0), layout=mesh, rank=0, global_batch_size=16)
    assert pos.grad_accum == 2


# ---------------------------------------------------------------------- end to end
def _launch(launcher: Launcher, tmp: Path, name: str, mesh: tuple[int, int, int], *args: str):
    rep, shard, tp = mesh
    code, out, err = launcher.run(
        run_cmd(
            f"--nproc-per-node={rep * shard * tp}",
            "--max-restarts=0",
            f"--run-dir={tmp / name / 'run'}",
            f"--checkpoint-url={tmp / name / 'ckpt'}",
            WORKER,
            f"--record={tmp / name / 'rec'}",
            f"--dp-replicate={rep}",
            f"--dp-shard={shard}",
            f"--tp={tp}",
            f"--batch={BATCH}",
            *args,
        ),
        timeout=150,
    )
    assert code == 0, (out[-2000:], err[-4000:])


def _steps(rec: Path) -> dict[int, list[dict[str, Any]]]:
    return last_by_step(records(rec))


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_resume_on_another_mesh_continues_at_the_exact_sample(
    tmp_path: Path, launcher: Launcher
) -> None:
    _launch(launcher, tmp_path, "first", (1, 2, 2), "--steps=8", "--stop-at=4")
    for name in ("tp1", "dp1"):
        shutil.copytree(tmp_path / "first", tmp_path / name)
    _launch(launcher, tmp_path, "tp1", (1, 2, 1), "--steps=8")
    _launch(launcher, tmp_path, "dp1", (1, 1, 2), "--steps=8")

    order, gb = _order(len(_dataset())), 2 * BATCH
    for name in ("tp1", "dp1"):
        final = _steps(tmp_path / name / "rec")
        assert sorted(final) == list(range(8)), name
        for step, recs in final.items():
            # tp peers drew one batch; the data-parallel ranks together the step's global batch
            by_dp: dict[int, list[int]] = {}
            for r in recs:
                assert by_dp.setdefault(r["dp_rank"], r["ids"]) == r["ids"], (name, step)
            ids = sorted(i for v in by_dp.values() for i in v)
            assert ids == sorted(order[step * gb : (step + 1) * gb]), (name, step)
        resumed = [r for s, rs in final.items() if s >= 4 for r in rs]
        want_dp, want_accum = (2, 1) if name == "tp1" else (1, 2)
        assert {(r["dp"], r["accum"]) for r in resumed} == {(want_dp, want_accum)}, name
        reshard = run_events(tmp_path / name / "run", "data.reshard")  # one per rank
        assert len(reshard) == 2 and {
            (e["saved_dp"], e["dp"], e["consumed"], e["global_batch"], e["grad_accum"])
            for e in reshard
        } == {(2, want_dp, 4 * gb, gb, want_accum)}, name
        load = run_events(tmp_path / name / "run", "ckpt.load.reshard")
        assert len(load) == 2 and {(e["bitwise"], e["saved_mesh"]) for e in load} == {
            (False, "replicate=1,shard=2,tp=2")
        }
