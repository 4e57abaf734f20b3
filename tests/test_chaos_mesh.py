"""The chaos harness on device meshes (issue 36, chaos/mesh.py): scenarios of
recipes/train_nd.py with a `mesh`, the `resize` fault, the sample check and the soak's mesh
draws. The scenarios themselves run in tests/test_chaos.py's matrix (CI: mesh_tp_kill and
mesh_hsdp_kill; the rest in `make soak`); what is here takes milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chaos.check_numeric import _pipeline
from chaos.draw import generate
from chaos.launch import _launch_cmd, launch_shape, run_env
from chaos.mesh import _order, check_samples, mesh_args
from chaos.plan import plan
from chaos.scenario import Fault, Scenario, expected_recovery
from recipes.common.data import build_dataset
from resilient.envvars import ENV_WATCHDOG

TP = {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
HSDP = {"dp_replicate": 2, "dp_shard": 2, "tp": 1}


def _mesh(**kw) -> Scenario:
    base = {"name": "m", "recipe": "train_nd.py", "nproc": 4, "mesh": TP, "steps": 12}
    base["corpus_chars"] = 40_000
    return Scenario.from_dict({**base, **kw})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"mesh": {"dp": 2, "tp": 2}}, "mesh names ['dp']"),
        ({"mesh": {"dp_shard": 0, "tp": 2}}, "integers >= 1"),
        ({"nproc": 2}, "set nproc = 4"),
        ({"recipe": "train_fsdp.py"}, "runs train_nd.py, not train_fsdp.py"),
        ({"mesh": {}}, "need mesh = {...}"),
        ({"corpus_chars": 20_000, "mesh": HSDP}, "set corpus_chars >= "),
        ({"fault": [{"kind": "resize", "at_step": 7}]}, "a resize needs one"),
        ({"fault": [{"kind": "kill", "at_step": 7, "mesh": TP}]}, "a resize needs one"),
        (
            {"hot": True, "fault": [{"kind": "resize", "at_step": 7, "mesh": TP}]},
            "run resize scenarios cold",
        ),
        (
            {"fault": [{"kind": "resize", "at_step": 7, "mesh": {"dp_shard": 4, "tp": 1}}]},
            "does not split over the data-parallel degree 4",
        ),
        (
            {
                "fault": [
                    {"kind": "resize", "at_step": 5, "mesh": {"dp_shard": 1, "tp": 2}},
                    {"kind": "kill", "rank": 3, "at_step": 8},
                ]
            },
            "fault rank 3 not in the world of 2 then",
        ),
    ],
)
def test_bad_mesh_scenarios_are_refused_with_the_reason(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("{", r"\{")):
        _mesh(**data)


def test_a_mesh_scenario_round_trips_and_keys_its_golden_by_mesh(tmp_path: Path) -> None:
    sc = _mesh(fault=[{"kind": "resize", "at_step": 7, "mesh": {"dp_shard": 1, "tp": 2}}])
    path = tmp_path / "m.toml"
    path.write_text(sc.to_toml())
    assert Scenario.load(path) == sc
    assert sc.golden_key().endswith("-c40000-m1x2x2")
    assert _mesh(mesh=HSDP).golden_key().endswith("-m2x2x1")
    # a pipeline: pp named, outermost, and train_nd's --pp flag; without one, no --pp
    pp = {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1}
    assert _mesh(mesh=pp).golden_key().endswith("-mpp2x1x2x1")
    assert mesh_args(pp)[0] == "--pp=2" and not any(a.startswith("--pp") for a in mesh_args(TP))
    # a NaN born on stage 0 is seen in the loss on the last stage of the same pipeline
    assert _pipeline(_mesh(mesh=pp), 0) == [0, 2] and _pipeline(_mesh(), 3) == [3]
    # hot mode has no micro-batches on the mesh recipe: the cold run is its fault-free run
    assert _mesh(hot=True).golden_key() == _mesh().golden_key()


def test_a_resize_is_a_cold_relaunch_on_its_mesh(tmp_path: Path) -> None:
    """A resize ends its launch (the harness SIGKILLs it) and the next launch runs on the
    fault's mesh: nproc and train_nd's flags from it, every rank logging its samples."""
    small = {"dp_replicate": 1, "dp_shard": 1, "tp": 2}
    sc = _mesh(
        fault=[
            {"kind": "kill", "rank": 3, "at_step": 5},
            {"kind": "resize", "at_step": 7, "mesh": small},
        ],
    )
    got = [(p.fault.kind, p.launch, p.restart, p.attempt, p.expect) for p in plan(sc)]
    assert got == [("kill", 0, 0, 0, "cold"), ("resize", 0, 1, 1, "cold")]
    assert launch_shape(sc, 0) == (4, TP) and launch_shape(sc, 1) == (2, small)
    assert expected_recovery(Fault(kind="resize", mesh=small), hot=True) == "cold"
    cmd = _launch_cmd(sc, tmp_path, "ckpt", 4, [], launch=1)
    assert "--nproc-per-node=2" in cmd
    assert {"--dp-replicate=1", "--dp-shard=1", "--tp=2"} <= set(cmd)
    assert cmd[cmd.index("--sample-log") + 1] == str(tmp_path / "samples")
    first = _launch_cmd(sc, tmp_path, "ckpt", 4, [], launch=0)
    assert "--nproc-per-node=4" in first and "--dp-shard=2" in first
    # four ranks on two cores: the watchdog is scaled up for mesh runs, and (d) with it
    assert json.loads(run_env(sc)[ENV_WATCHDOG])["timeout_s"] == 30.0
    assert json.loads(run_env(Scenario(name="d"))[ENV_WATCHDOG])["timeout_s"] == 10.0


def _write(dir_: Path, rows: list[dict]) -> None:
    dir_.mkdir(parents=True, exist_ok=True)
    for rank in {r["rank"] for r in rows}:
        with (dir_ / f"rank{rank}.jsonl").open("a") as f:
            for r in rows:
                if r["rank"] == rank:
                    f.write(json.dumps(r) + "\n")


def test_the_sample_check_passes_the_sampler_order_across_a_resize_and_fails_a_skip(
    tmp_path: Path,
) -> None:
    """Steps 0-7 on dp=2 x tp=2 (4 ranks), then a resize to dp=1 x tp=2 from checkpoint 4:
    steps 4-11 again on 2 ranks, two micro-batches of 8 per step. The later records of
    steps 4-7 win; the check passes. A step that skipped one batch, or a tp peer on other
    samples, fails."""
    sc = _mesh()
    n = len(build_dataset(block_size=64, num_chars=sc.corpus_chars, seed=sc.seed)[0])
    order, gb = _order(n, sc.seed), 16
    rows, t = [], 0.0
    for step in range(8):  # the sampler: dp rank r takes order[r::2], 8 a step
        for rank in range(4):
            dp_rank = rank // 2
            ids = order[dp_rank::2][step * 8 : step * 8 + 8]
            t += 1
            rows.append({"rank": rank, "world": 4, "dp": 2, "dp_rank": dp_rank, "step": step,
                         "accum": 1, "ids": ids, "t": t})  # fmt: skip
    for step in range(4, 12):
        for rank in range(2):
            t += 1
            ids = order[step * gb : (step + 1) * gb]
            rows.append({"rank": rank, "world": 2, "dp": 1, "dp_rank": 0, "step": step,
                         "accum": 2, "ids": ids, "t": t})  # fmt: skip
    _write(tmp_path / "ok", rows)
    failures: list[str] = []
    summary = check_samples(sc, tmp_path / "ok", failures)
    assert summary.startswith("pass (12 steps, global batch 16") and not failures, summary
    assert "world 2 dp 1 x2" in summary and "world 4 dp 2 x1" in summary

    skipped = [dict(r) for r in rows]
    for r in skipped:
        if r["world"] == 2 and r["step"] >= 9:  # a batch skipped after the resize
            r["ids"] = order[(r["step"] + 1) * gb : (r["step"] + 2) * gb]
    _write(tmp_path / "skip", skipped)
    failures = []
    assert check_samples(sc, tmp_path / "skip", failures).startswith("fail")
    assert any("step 9: trained on 16 samples, not the 16 of its offset" in f for f in failures)

    apart = [dict(r) for r in rows]
    for r in apart:
        if r["rank"] == 1 and r["step"] == 2:
            r["ids"] = [*r["ids"][:-1], order[-1]]
    _write(tmp_path / "apart", apart)
    failures = []
    check_samples(sc, tmp_path / "apart", failures)
    assert any("rank 1 drew other samples than its tp peers" in f for f in failures)


def test_the_soak_draws_mesh_shapes_from_a_generator_of_their_own() -> None:
    plain = generate(2026, 200, hot_fraction=0.25, hot_lost=True, numeric_fraction=0.1)
    mixed = generate(
        2026, 200, hot_fraction=0.25, hot_lost=True, numeric_fraction=0.1, mesh_fraction=0.1
    )
    meshes = [sc for sc in mixed if sc.mesh]
    assert 8 <= len(meshes) <= 35
    assert all(a == b for a, b in zip(plain, mixed, strict=True) if not b.mesh)
    assert {tuple(sc.mesh.values()) for sc in meshes} == {(1, 2, 2), (2, 2, 1)}
    kinds = {f.kind for sc in meshes for f in sc.faults}
    assert kinds <= {"kill", "sigstop", "nan", "resize"} and "resize" in kinds
    assert {sc.hot for sc in meshes} == {True, False}
    assert not any(sc.hot and f.kind == "resize" for sc in meshes for f in sc.faults)
    # no lost process hot without --hot-recovery: those draws stay cold
    no_lost = generate(2026, 200, hot_fraction=0.25, mesh_fraction=0.1)
    assert not any(sc.hot for sc in no_lost if sc.mesh)
