"""The chaos harness: scenario files, the seeded generator, and the fast matrix CI runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from chaos.__main__ import SCENARIOS
from chaos.draw import generate, repeated
from chaos.plan import plan
from chaos.runner import run_scenario
from chaos.scenario import (
    FAULT_KINDS,
    HOT_ONLY,
    LOST_PROCESS,
    NUMERIC,
    SDC_PHASES,
    Fault,
    Scenario,
    expected_recovery,
)


def test_scenario_toml_round_trip(tmp_path: Path):
    sc = Scenario(name="x", steps=20, faults=[Fault(kind="corrupt", rank=0, at_step=9)])
    path = tmp_path / "x.toml"
    path.write_text(sc.to_toml())
    assert Scenario.load(path) == sc


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "x", "fault": [{"kind": "meteor"}]}, "unknown fault kind"),
        ({"name": "x", "colour": "red"}, "unknown scenario keys"),
        ({"name": "x", "steps": 5, "fault": [{"kind": "kill", "at_step": 7}]}, ">= steps"),
        ({"name": "x", "fault": [{"kind": "kill", "rank": 2}]}, "not in [0, 2)"),
        ({"name": "x", "fault": [{"kind": "storage_errors"}]}, 'need storage = "s3"'),
        ({"name": "x", "storage": "s3", "fault": [{"kind": "disk_full"}]}, "disk_full needs"),
        ({"name": "x", "storage": "nfs"}, "storage must be local or s3"),
        ({"name": "x", "fault": [{"kind": "raise", "phase": "lunch"}]}, "phase must be one of"),
        ({"name": "x", "fault": [{"kind": "node_loss"}]}, "need hosts = 2"),
        ({"name": "x", "fault": [{"kind": "nan", "phase": "backward"}]}, "phase must be forward"),
        ({"name": "x", "fault": [{"kind": "spike"}]}, "only with numeric.spike_factor"),
        (
            {"name": "x", "numeric": {"spike_factor": 2000.0}, "fault": [{"kind": "spike"}]},
            "only with numeric.spike_factor set below it",
        ),
        (
            {
                "name": "x",
                "numeric": {"spike_factor": 5, "spike_window": 9},
                "fault": [{"kind": "spike", "at_step": 6}],
            },
            "before the running mean spans",
        ),
        ({"name": "x", "numeric": {"policy": "maybe"}}, "numeric: numeric policy must be"),
        ({"name": "x", "numeric": {"colour": 1}}, "unknown numeric option"),
        ({"name": "x", "fault": [{"kind": "kill", "factor": 3.0}]}, "factor is for spike"),
        (
            {
                "name": "x",
                "fault": [{"kind": "bad_batch", "at_step": 7}, {"kind": "kill", "at_step": 9}],
            },
            "a fault after it would never run",
        ),
        (
            {"name": "x", "hot": True, "recipe": "train_fsdp.py", "fault": [{"kind": "sigterm"}]},
            "hot mode takes only",
        ),
        (
            {"name": "x", "hot": True, "fault": [{"kind": "kill_during_replication"}]},
            "only sharded state",
        ),
        (
            {"name": "x", "hosts": 2, "nproc": 1, "fault": [{"kind": "node_loss", "rank": 0}]},
            "on a rank of the second host",
        ),
    ],
)
def test_bad_scenarios_are_refused_with_the_reason(data: dict, message: str):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        Scenario.from_dict(data)


def test_generator_is_seeded_and_valid():
    a, b = generate(7, 200), generate(7, 200)
    assert a == b
    assert generate(8, 200) != a
    kinds = {f.kind for sc in a for f in sc.faults}
    # every one-host kind of cold mode, in 200 schedules (numerical faults have their own draw)
    assert kinds == set(FAULT_KINDS) - {"node_loss", "resize"} - HOT_ONLY - NUMERIC
    assert {sc.storage for sc in a} == {"local", "s3"}
    for sc in a:  # Scenario's own checks ran at construction; faults land after a save
        assert all(sc.save_every < f.at_step < sc.steps - sc.save_every for f in sc.faults)


def test_plan_counts_attempts_and_launches():
    """A preemption ends the launch (the runner launches again, restart count back to 0); a
    retried storage fault ends nothing; every other fault restarts the group."""
    sc = Scenario(
        name="p",
        storage="s3",
        max_restarts=5,
        faults=[
            Fault(kind="raise", at_step=5),
            Fault(kind="storage_errors", at_step=7),
            Fault(kind="sigterm", at_step=9),
            Fault(kind="oom", at_step=11),
        ],
    )
    got = [(p.fault.kind, p.launch, p.restart, p.attempt) for p in plan(sc)]
    assert got == [
        ("raise", 0, 0, 0),
        ("storage_errors", 0, 1, 1),
        ("sigterm", 0, 1, 1),
        ("oom", 1, 0, 2),
    ]


_NOT_IN_MATRIX = {
    # run by test_hot_mode_in_process_faults_recover_as_expected_and_end_bit_exact, which
    # checks every invariant of it and its report besides
    "hot_in_process",
    # `make soak` runs it (python -m chaos matrix); in CI its paths are tests/test_hot.py's
    # exception tests (a replacement, then the same failure again going cold)
    "hot_fsdp_in_process",
    # the same: tests/test_hot.py's exception under rt.guard() is its path in CI
    "hot_outside_step",
}
# Run by `make soak` only (marked `extended`), to keep CI under its 20 minutes; in CI their
# paths are covered fault by fault, each run checked bitwise:
_EXTENDED = {
    # tests/test_hot.py: kill -9, OOM exit, a kill inside a snapshot or its replication, a
    # save lost with the peer, a rank lost with its buddy (cold), for DDP and FSDP2
    "hot_lost_process",
    "hot_fsdp_lost_process",
    # tests/test_hang.py: a stopped rank and a sleeping one, named and the group restarted
    "hangs",
    # tests/test_preempt.py: SIGTERM to the launcher and to one worker, zero steps lost
    "preemption",
    # tests/test_elastic.py: a host killed (and cut off) twice, the other going on alone
    "node_loss",
    # tests/test_checkpoint.py and tests/test_cli_errors.py: truncated, deleted and corrupt
    # files fall back to the previous checkpoint, a corrupt one is never loaded
    "truncate_delete",
    "corrupt_then_kill",
    # tests/test_s3.py: saves, loads and faults against the S3 server on loopback
    "s3_storage",
    # tests/test_guard.py: exceptions agreed by every rank, rolled back or restarted
    "exceptions",
    # tests/test_checkpoint.py: a full disk fails the save, the previous one stays valid
    "disk_full",
    # numerical faults (issue 27): CI runs bad_batch_skip, whose path holds the others' (a
    # fault seen and agreed before the update, a cold restart recorded in the checkpoint
    # location, the step failing again, the finite checkpoints and the one kept); the
    # rollback in place, the spike and the stop run here
    "nan_hot",
    "nan_fsdp_cold",
    "spike_fsdp_hot",
    "bad_batch_stop",
    # a bit flipped in one of three DDP replicas, named by the majority (25 s with its
    # fault-free run); CI runs bitflip_rerun (two ranks, the save's own check sees it)
    "bitflip_majority",
    # meshes (tests/test_chaos_mesh.py): CI runs mesh_tp_kill and mesh_hsdp_kill (bitwise, the
    # samples exact); these run the three faults cold and hot on each mesh and the resizes
    # (4 ranks on two cores: about a minute each, or more). mesh_tp_hot: CI's budget, and
    # a cold fallback still seen once in 8 dp x tp hot runs (docs/hot-recovery.md)
    "mesh_tp_hot",
    "mesh_tp_faults_cold",
    "mesh_hsdp_faults_cold",
    "mesh_tp_faults_hot",
    "mesh_hsdp_faults_hot",
    "mesh_resize_dp",
    "mesh_resize_tp",
    "mesh_resize_hsdp",
    # pipelines (issue 37; 80-100 s each on two loaded cores): pp=2 x dp_shard=2 and
    # pp=4 killed, cold, bitwise; pp=2 x dp_shard=2 resized to pp=1. CI runs the pp=2 x dp=2
    # kill of tests/test_pipeline.py (DDP in the stages) instead
    "mesh_pp_kill",
    "mesh_pp4_kill",
    "mesh_resize_pp",
    # a kill, a SIGSTOP and a NaN on pp=2 x dp_shard=2, cold (about 170 s); two SIGTERMs
    # (about 230 s at a load of 14)
    "mesh_pp_faults_cold",
    "mesh_pp_preempt",
    # the same three faults hot on pp=2 x dp_shard=2, and cold on pp=4 (CI runs mesh_pp_hot,
    # one stage rank killed hot, and tests/test_pipeline.py's hot replacements)
    "mesh_pp_faults_hot",
    "mesh_pp4_faults_cold",
    "mesh_pp4_preempt",
}
_MATRIX = [
    pytest.param(p, id=p.stem, marks=[pytest.mark.extended] if p.stem in _EXTENDED else [])
    for p in sorted(SCENARIOS.glob("*.toml"))
    if p.stem not in _NOT_IN_MATRIX
]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", _MATRIX)
def test_matrix_scenario_keeps_every_invariant(path: Path, tmp_path_factory):
    out = tmp_path_factory.getbasetemp() / "chaos"  # shared: golden runs are computed once
    sc = Scenario.load(path)
    result = run_scenario(sc, out)
    if result.skipped:
        pytest.skip(result.skipped)  # disk_full without root: no tmpfs to fill
    assert result.ok, f"{result.failures}\n{result.checks}\nkept in {result.run_dir}"
    if sc.stops_at() is not None:  # a bad batch stopped it (87): no final state to compare
        assert result.checks["a_bitwise_equal"].startswith("n/a (stopped")
        assert result.checks["h_numeric"].endswith("-> stop, exit 87")
    elif sc.hosts == 1 and not any(f.kind == "resize" for f in sc.faults):
        assert result.checks["a_bitwise_equal"] == "pass"
    else:  # the world shrank or the mesh changed: bits differ by design, the run must finish
        assert result.checks["a_bitwise_equal"].endswith("finished: pass")
    if sc.mesh:  # every step on the samples of the sampler's order (chaos/mesh.py)
        assert result.checks["i_samples"].startswith("pass")
    assert result.checks["e_no_leftover"] == "pass"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checker_fails_a_run_that_does_not_match_golden(tmp_path: Path):
    """The checker must be able to fail: a run that does not end on the golden digest.
    No fault-free run is needed for that: the golden record is written with a digest no run
    has, and the scenario's own timeout as the time bound (twice the fault-free time is
    capped at it)."""
    sc = Scenario(
        name="mismatch", steps=8, save_every=4, faults=[Fault(kind="kill", rank=1, at_step=5)]
    )
    forged = tmp_path / "golden" / sc.golden_key()
    forged.mkdir(parents=True)
    gold = {"step": sc.steps, "world_size": sc.nproc, "digest": "0" * 64, "wall_s": sc.timeout_s}
    (forged / "golden.json").write_text(json.dumps(gold))
    result = run_scenario(sc, tmp_path)
    assert not result.ok
    assert result.checks["a_bitwise_equal"].startswith("fail")
    assert Path(result.run_dir, "scenario.toml").exists()  # kept for reproduction


@pytest.mark.timeout(30)
def test_kill_tree_reaches_a_child_in_its_own_session(tmp_path: Path):
    """torch elastic starts each worker in a session of its own: killing the launcher's
    process group would leave it running, so Run.kill() kills the whole tree."""
    import sys
    import time

    from chaos.procs import Run, alive, descendants

    child = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "start_new_session=True); time.sleep(60)"
    )
    with Run([sys.executable, "-c", child], log_path=tmp_path / "log") as run:
        deadline = time.monotonic() + 10
        while not descendants(run.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        (grandchild,) = descendants(run.proc.pid)
        # Between its fork and its setsid() the grandchild is still in the parent's group.
        while os.getsid(grandchild) != grandchild and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.getpgid(grandchild) != os.getpgid(run.proc.pid)
        run.kill()
    assert not alive(run.proc.pid)
    assert not alive(grandchild)


def test_soak_summary_counts_kinds_losses_and_failures():
    from chaos.summary import summarize

    a, b = generate(5, 2)
    results = [
        {
            "scenario": a.name,
            "ok": True,
            "wall_s": 30.0,
            "golden_wall_s": 10.0,
            "checks": {"b_steps_lost": f"[{', '.join('3' for _ in a.faults)}] (interval 4)"},
            "faults": [{"kind": f.kind} for f in a.faults],
            "failures": [],
        },
        {
            "scenario": b.name,
            "ok": False,
            "wall_s": 20.0,
            "golden_wall_s": 10.0,
            "checks": {"b_steps_lost": f"[{', '.join('6' for _ in b.faults)}] (interval 4)"},
            "faults": [{"kind": f.kind} for f in b.faults],
            "failures": ["a: final digest x != golden y"],
        },
    ]
    text = summarize(results)
    assert text.startswith("2 scenarios: 1 passed, 1 failed, 0 skipped.")
    for f in b.faults:
        assert f"| `{f.kind}` |" in text
    assert "median 2.50, max 3.00" in text
    assert f"- {b.name}: a: final digest x != golden y" in text


def test_checker_counts_a_load_only_after_the_damage(tmp_path: Path):
    """soak-2026-0062: step 12 was loaded intact, then truncated, then the next attempt fell
    back to 8 and saved 12 again. Only a load of 12 after the damage and before the re-save
    breaks (c); the first checker counted the earlier, intact load."""
    from datetime import datetime, timezone

    from chaos.check import _check
    from chaos.external import Injected

    t0 = 1_800_000_000.0

    def ev(t: float, event: str, **kw) -> str:
        ts = datetime.fromtimestamp(t0 + t, timezone.utc).isoformat().replace("+00:00", "Z")
        return json.dumps({"event": event, "ts": ts, "rank": 0, **kw})

    def run(load_after_damage: int | None, fallback: bool = True) -> tuple[dict, list[str]]:
        """None: the restart found nothing valid and started fresh."""
        out = tmp_path / f"r{load_after_damage}-{fallback}"
        (out / "run" / "logs").mkdir(parents=True, exist_ok=True)
        lines = [
            ev(0, "runtime.init", pid=1),
            ev(1, "runtime.resume", step=0),
            *(ev(1 + s / 4, "ckpt.save.committed", step=s) for s in (4, 8, 12)),
            ev(10, "runtime.init", pid=2),
            ev(11, "ckpt.load", step=12),  # before the damage at t=12: intact
            ev(11, "runtime.resume", step=12),
            # a newer save can commit between the harness's listing and its kill
            *([ev(15, "ckpt.save.committed", step=16)] if load_after_damage == 16 else []),
            ev(20, "runtime.init", pid=3),
            *([ev(21, "ckpt.fallback", step=12)] if fallback else []),
            ev(21, "ckpt.load", step=load_after_damage)
            if load_after_damage is not None
            else ev(21, "ckpt.fresh_start"),
            ev(21, "runtime.resume", step=load_after_damage or 0),
        ]
        (out / "run" / "logs" / "rank0.jsonl").write_text("\n".join(lines) + "\n")
        (out / "run" / "final_digest.json").write_text(json.dumps({"digest": "d", "step": 24}))
        steps = lambda a, b: "".join(f"step {i} loss 1.0\n" for i in range(a, b))  # noqa: E731
        (out / "stdout.log").write_text(
            f"runtime.resume\n{steps(0, 14)}runtime.resume\n{steps(12, 15)}"
            f"runtime.resume\n{steps(load_after_damage or 0, 24)}"
        )
        sc = Scenario(
            name="c",
            faults=[Fault(kind="kill_during_save", at_step=13), Fault(kind="truncate", at_step=14)],
        )
        injected = [
            Injected(kind="kill_during_save", rank=0, pid=1, wall_time=t0 + 5, attempt=0),
            Injected(
                kind="truncate", rank=0, pid=2, wall_time=t0 + 12, attempt=1, corrupted_step=12
            ),
        ]
        failures: list[str] = []
        checks = _check(sc, out, {"digest": "d", "wall_s": 10.0}, plan(sc), injected, 20.0,
                        False, failures)  # fmt: skip
        return checks, failures

    checks, failures = run(load_after_damage=8)
    assert checks["c_no_corrupt_load"] == "pass" and not [f for f in failures if f[0] == "c"]
    checks, failures = run(load_after_damage=12)
    assert checks["c_no_corrupt_load"] == "fail (loaded [12])"
    # the damage must have been noticed: a silent step back to 8, or to a fresh start, fails
    for load in (8, None):
        _, failures = run(load_after_damage=load, fallback=False)
        assert [f for f in failures if "no fallback was logged" in f], (load, failures)
        _, failures = run(load_after_damage=load, fallback=True)
        assert not [f for f in failures if f.startswith("c")], (load, failures)
    # ...but a newer intact checkpoint loaded after the damage needs no fallback
    _, failures = run(load_after_damage=16, fallback=False)
    assert not [f for f in failures if f.startswith("c")], failures


def test_hot_mode_is_drawn_from_its_own_generator_and_keeps_the_cold_schedules():
    """A soak mixes hot runs in; the cold schedules of a seed stay the ones it always drew,
    and a hot run has only hot kinds, on the DDP recipe, inside the guarded step."""
    cold = generate(2026, 100)
    mixed = generate(2026, 100, hot_fraction=0.3)
    assert mixed == generate(2026, 100, hot_fraction=0.3)
    hot = [sc for sc in mixed if sc.hot]
    assert 15 <= len(hot) <= 45
    assert all(a == b for a, b in zip(cold, mixed, strict=True) if not b.hot)
    assert all(sc.recipe == "train_ddp.py" for sc in hot)
    kinds = {f.kind for sc in hot for f in sc.faults}
    assert kinds == {"raise", "oom", "raise_twice"}  # no lost process without --hot-recovery
    assert {f.phase for sc in hot for f in sc.faults} == {"forward", "backward"}
    lost = {f.kind for sc in generate(2026, 100, hot_fraction=0.3, hot_lost=True) if sc.hot
            for f in sc.faults}  # fmt: skip
    assert {"kill", "oom_exit", "kill_during_snapshot", "kill_with_buddy"} <= lost
    assert {"kill_during_save", "hang", "sigstop"} <= lost
    # half of the lost-process-only draws run FSDP2, restored from the buddy's replica
    fsdp = [sc for sc in generate(2026, 200, hot_fraction=0.5, hot_lost=True)
            if sc.hot and sc.recipe == "train_fsdp.py"]  # fmt: skip
    assert len(fsdp) >= 10
    assert all(f.kind in LOST_PROCESS for sc in fsdp for f in sc.faults)
    assert "kill_during_replication" in {f.kind for sc in fsdp for f in sc.faults}


def test_a_hot_draw_puts_faults_after_the_save_a_kill_during_save_waits_for():
    """kill_during_save fires at the first save after its step and a hot recovery resumes
    there: a fault drawn in between would never run (soak 2026, run 0145)."""
    from chaos.draw import _after_saves

    faults = [Fault(kind="kill_during_save", at_step=12), Fault(kind="oom", at_step=13)]
    moved = _after_saves(faults, save_every=4, steps=24)
    assert [(f.kind, f.at_step) for f in moved] == [("kill_during_save", 12), ("oom", 17)]
    assert _after_saves(faults, save_every=4, steps=17) == faults[:1]  # no room: dropped
    late = [Fault(kind="kill_during_save", at_step=5), Fault(kind="kill", at_step=11)]
    assert _after_saves(late, save_every=4, steps=24) == late  # already past save 8


@pytest.mark.parametrize(
    ("kind", "phase", "expected"),
    [
        ("raise", "forward", "hot"),
        ("raise", "optimizer", "hot"),  # outside rt.micro_batches: the rank is replaced
        ("oom", "backward", "retry"),
        ("raise_twice", "forward", "cold"),
        ("kill", "forward", "hot"),
        ("oom_exit", "forward", "hot"),
        ("kill_during_snapshot", "forward", "hot"),
        ("kill_with_buddy", "forward", "cold"),
        ("kill_during_save", "forward", "hot"),
        ("hang", "forward", "hot"),
        ("sigstop", "forward", "hot"),
    ],
)
def test_hot_mode_expects_a_recovery_per_fault(kind: str, phase: str, expected: str):
    f = Fault(kind=kind, phase=phase)
    assert expected_recovery(f, hot=True) == expected
    assert expected_recovery(f, hot=False) == "cold"
    # FSDP2 has no in-place agreement: an exception or an OOM in its step is replaced warm
    fsdp = "hot" if kind in ("raise", "oom") else expected
    assert expected_recovery(f, hot=True, recipe="train_fsdp.py") == fsdp


def test_hot_mode_refuses_cold_only_kinds_and_keeps_fsdp2s_split():
    # FSDP2 takes in-step faults too (the rank is replaced warm), and no split changes
    sc = Scenario(name="h", hot=True, recipe="train_fsdp.py", faults=[Fault(kind="oom")])
    assert sc.splits() == []
    Scenario(name="h", hot=True, recipe="train_fsdp.py", faults=[Fault(kind="kill")])
    with pytest.raises(ValueError, match="hot mode takes only"):
        Scenario(name="h", hot=True, faults=[Fault(kind="corrupt")])
    # an OOM retried in place leaves a doubled split: the fault-free run must use it too
    sc = Scenario(
        name="h",
        hot=True,
        faults=[Fault(kind="oom", at_step=5), Fault(kind="oom", at_step=9, phase="backward")],
    )
    assert sc.splits() == [(5, 2), (9, 4)] and sc.golden_key().endswith("-micro-5x2-9x4")
    # an OOM outside the forward and backward: the rank is replaced warm and carries the
    # doubled split into the generation that replays its step
    sc = Scenario(name="h", hot=True, faults=[Fault(kind="oom", at_step=7, phase="optimizer")])
    assert expected_recovery(sc.faults[0], hot=True) == "hot"
    assert sc.splits() == [(7, 2)]


def test_a_fault_after_a_warm_replacement_is_armed_for_the_next_generation():
    # an exception outside the step replaces its rank (generation 1); the in-place
    # rollback after it does not; a kill -9 does again (generation 2)
    sc = Scenario.load(SCENARIOS / "hot_outside_step.toml")
    assert [p.generation for p in plan(sc)] == [0, 1]
    sc = Scenario(
        name="h",
        hot=True,
        max_restarts=5,
        faults=[
            Fault(kind="raise", at_step=5, phase="data"),
            Fault(kind="raise", at_step=7, phase="forward"),
            Fault(kind="kill", at_step=9),
            Fault(kind="oom", at_step=11),
        ],
    )
    assert [p.generation for p in plan(sc)] == [0, 1, 1, 2]


@pytest.mark.slow
@pytest.mark.extended  # 20 s: make soak; tests/test_hot.py covers each in-process fault in CI
@pytest.mark.timeout(120)
def test_hot_mode_in_process_faults_recover_as_expected_and_end_bit_exact(tmp_path: Path):
    """An exception rolled back in place, an OOM retried in place, and the same exception
    twice at one step, which must go cold: every invariant, and (g) the recovery of each."""
    sc = Scenario.load(SCENARIOS / "hot_in_process.toml")
    result = run_scenario(sc, tmp_path, keep=True)
    assert result.ok, f"{result.failures}\n{result.checks}"
    assert result.checks["a_bitwise_equal"] == "pass"
    assert result.checks["g_recovery"] == (
        "raise: hot (expected hot), oom: retry (expected retry), raise_twice: cold (expected cold)"
    )
    assert result.checks["b_steps_lost"].startswith("[0, 0, ")  # in place: nothing lost
    assert result.checks["e_no_leftover"] == "pass" and result.hot
    # `resilient report` on the real logs: each recovery's kind, labelled by its own fault
    from resilient.report import COLD, HOT_ROLLBACK, RETRY, analyze, format_report

    rep = analyze(Path(result.run_dir) / "run")
    assert [(f.kind, f.recovery) for f in rep.faults] == [
        ("raise", HOT_ROLLBACK),
        ("oom", RETRY),
        ("raise", HOT_ROLLBACK),  # raise_twice: the first firing is rolled back...
        ("raise", COLD),  # ...the second, at the same step, restarts the group
    ]
    assert all(f.exact_time and f.detect_s is not None for f in rep.faults)
    assert [f.steps_lost for f in rep.faults[:3]] == [0, 0, 0]
    # the first step after a recovery in place completes: a rollback and a retry recover;
    # the first firing of raise_twice does not (its step fails again)
    assert [f.recover_s is not None for f in rep.faults] == [True, True, False, True]
    assert rep.final_step == sc.steps and rep.attempts == 2
    assert "hot rollback" in format_report(rep)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("spec", "code", "phase"),
    [
        ("kill@rank=1,step=3,phase=snapshot", -9, "snapshot"),
        ("oom_exit@rank=1,step=3,phase=forward", 83, "forward"),
    ],
    ids=["kill_during_snapshot", "oom_exit"],
)
def test_lost_process_faults_fire_where_they_are_aimed(tmp_path: Path, spec, code, phase):
    """The injection behind the gated lost-process scenarios works today: rank 1 dies inside
    its snapshot copy (or leaves with the OOM exit code in its forward) at step 3, and says
    so in chaos.jsonl; its peer is left to the peer-loss path (plain ranks, no launcher)."""
    from helpers import assert_no_process_left

    from chaos.observe import _chaos_records
    from chaos.ranks import Ranks
    from resilient.exitcodes import ExitCode

    argv = ["-m", "chaos.inject", "--fault", spec, "--", "tests/workers/guarded_train.py"]
    argv += ["--mode", "micro", "--steps", "6", "--ckpt-dir", str(tmp_path / "ckpt")]
    argv += ["--run-dir", str(tmp_path / "run")]
    env = {
        "RESILIENT_WATCHDOG": json.dumps({"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 5}),
        "RESILIENT_SNAPSHOT": json.dumps({"enabled": True, "every_steps": 1}),
    }
    ranks = Ranks(2, argv, log_dir=tmp_path / "out", env=env)
    try:
        codes = ranks.wait(90)
        assert_no_process_left(ranks, tmp_path / "run")
    finally:
        ranks.kill()
    assert codes[1] == code, codes
    assert codes[0] not in (0, None), codes  # rank 0 lost its peer: it must not finish
    assert codes[0] != ExitCode.OK
    (fault,) = _chaos_records(tmp_path / "run")
    assert (fault["rank"], fault["step"], fault["phase"]) == (1, 3, phase)


def test_a_small_disk_fills_to_the_last_block_and_again_after_a_deletion(tmp_path: Path):
    """disk_full's filler takes every free byte in pieces, and takes again what a deletion
    freed (one fallocate of all the free space took nothing when a save wrote meanwhile:
    soak 2026, run 0199 waited 300 s for a save to fail)."""
    from chaos.storage import SmallDisk, small_disk_unavailable

    if (why := small_disk_unavailable()) is not None:
        pytest.skip(why)
    with SmallDisk(tmp_path / "disk", size_mib=8) as disk:
        other = disk.path / "old-checkpoint"
        other.write_bytes(b"x" * (2 << 20))
        assert disk.fill() > 4 << 20
        assert disk.info()["free_bytes"] < 64 << 10
        with pytest.raises(OSError):  # a save meets ENOSPC
            (disk.path / "new").write_bytes(b"y" * (1 << 20))
        (disk.path / "new").unlink(missing_ok=True)
        other.unlink()  # retention deletes an old checkpoint
        assert disk.fill() >= (2 << 20) - (64 << 10)
        assert disk.info()["free_bytes"] < 64 << 10
        disk.free()
        assert disk.info()["free_bytes"] > 6 << 20


# ------------------------------------------------------------- numerical faults (issue 27)
def test_numerical_faults_expect_a_rollback_or_a_restart_then_a_skip_or_a_stop():
    nan = Fault(kind="nan", at_step=10)
    assert expected_recovery(nan, hot=True) == "hot"
    assert expected_recovery(nan, hot=True, recipe="train_fsdp.py") == "hot"  # in place too
    assert expected_recovery(nan, hot=False) == "cold"
    bad = Fault(kind="bad_batch", at_step=10)
    assert expected_recovery(bad, hot=True) == "hot then stop"
    assert expected_recovery(bad, hot=False, policy="skip") == "cold then skip"
    # a numerical fault never replaces a process: later faults stay in generation 0
    sc = Scenario(
        name="n",
        hot=True,
        recipe="train_fsdp.py",
        numeric={"policy": "skip"},
        faults=[Fault(kind="nan", at_step=6), Fault(kind="bad_batch", at_step=9),
                Fault(kind="kill", at_step=13)],
    )  # fmt: skip
    assert [(p.expect, p.restarts, p.generation) for p in plan(sc)] == [
        ("hot", False, 0),
        ("hot then skip", False, 0),
        ("hot", False, 0),
    ]
    cold = Scenario(name="n", faults=[Fault(kind="bad_batch", at_step=9)])
    ((p,),) = [plan(cold)]
    assert (p.expect, p.restarts) == ("cold then stop", True)  # restarts once, then stops
    assert cold.stops_at() == 9 and cold.expected_exit == 87


def test_a_skip_is_compared_with_the_skip_golden_and_a_stop_with_nothing():
    from chaos.launch import _spec

    skip = Scenario.load(SCENARIOS / "bad_batch_skip.toml")
    assert skip.skip_steps() == [11] and skip.stops_at() is None and skip.expected_exit == 0
    assert skip.golden_key().endswith("-skip11")  # its own fault-free run
    plain = Scenario(name="p", faults=[Fault(kind="nan", at_step=11)])
    assert plain.skip_steps() == [] and "-skip" not in plain.golden_key()
    # max_skips: the second bad batch is past it and stops the run
    two = Scenario(
        name="t",
        numeric={"policy": "skip", "max_skips": 1},
        faults=[Fault(kind="bad_batch", at_step=6), Fault(kind="bad_batch", at_step=10)],
    )
    assert two.skip_steps() == [6] and two.stops_at() == 10
    assert [p.expect for p in plan(two)] == ["cold then skip", "cold then stop"]
    # a bad batch is armed for every attempt and generation; a NaN for its own only
    (bad,) = plan(skip)
    assert "restart=any" in _spec(bad) and "generation=any" in _spec(bad)
    (nan,) = plan(plain)
    assert ",restart=0,generation=0" in _spec(nan)
    spike = Scenario.load(SCENARIOS / "spike_fsdp_hot.toml")
    assert _spec(plan(spike)[0]).endswith(",factor=1000")
    # the TOML round trip keeps the numeric table and the factor
    for sc in (skip, spike, two):
        assert Scenario.from_dict(__import__("tomllib").loads(sc.to_toml())) == sc


def test_numerical_faults_have_a_draw_of_their_own_that_keeps_every_other_schedule():
    """Soak runs with a numerical fault come from a generator of their own: every other
    index keeps the schedule the seed drew before they existed (cold and hot alike)."""
    before = generate(2026, 200, hot_fraction=0.25, hot_lost=True)
    mixed = generate(2026, 200, hot_fraction=0.25, hot_lost=True, numeric_fraction=0.1)
    assert mixed == generate(2026, 200, hot_fraction=0.25, hot_lost=True, numeric_fraction=0.1)
    numeric = [sc for sc in mixed if any(f.kind in NUMERIC for f in sc.faults)]
    assert 8 <= len(numeric) <= 35
    assert all(a == b for a, b in zip(before, mixed, strict=True) if b not in numeric)
    assert all(len(sc.faults) == 1 and sc.storage == "local" for sc in numeric)
    assert {f.kind for sc in numeric for f in sc.faults} == NUMERIC
    assert {sc.recipe for sc in numeric} == {"train_ddp.py", "train_fsdp.py"}
    assert {sc.hot for sc in numeric} == {True, False}
    assert {sc.numeric_policy for sc in numeric if sc.faults[0].kind == "bad_batch"} == {
        "skip",
        "stop",
    }
    assert not any(f.kind in NUMERIC for sc in before for f in sc.faults)


def test_repeat_takes_the_numerical_kinds_in_the_forward():
    runs = repeated("spike", "train_fsdp.py", 1, 5)
    assert all(sc.hot and sc.faults[0].phase == "forward" for sc in runs)
    assert all(sc.numeric == {"spike_factor": 5.0, "spike_window": 3} for sc in runs)
    bad = repeated("bad_batch", "train_ddp.py", 1, 2, hot=False, numeric={"policy": "skip"})
    assert [p.expect for sc in bad for p in plan(sc)] == ["cold then skip"] * 2
    # the old kinds draw what they drew before (commit 35c0144's repeated())
    kills = [sc.faults[0] for sc in repeated("kill", "train_ddp.py", 3, 2)]
    assert [(f.rank, f.at_step, f.phase) for f in kills] == [(0, 18, "forward"), (1, 7, "forward")]
    assert all(sc.numeric == {} for sc in repeated("kill", "train_ddp.py", 3, 2))


def test_a_bad_batch_counts_once_though_every_attempt_records_it():
    from chaos.external import _first_firings

    records = [
        {"kind": "bad_batch", "rank": 1, "step": 11, "phase": "forward"},  # attempt 0
        {"kind": "raise", "rank": 0, "step": 12, "phase": "forward"},
        {"kind": "raise", "rank": 0, "step": 12, "phase": "forward", "repeat": 1},
        {"kind": "bad_batch", "rank": 1, "step": 11, "phase": "forward"},  # attempt 1
        {"kind": "kill", "source": "runner"},
    ]
    assert [r["kind"] for r in _first_firings(records)] == ["bad_batch", "raise"]


def test_the_numeric_check_fails_a_wrong_answer_a_false_positive_and_a_nan_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """(h) can fail: a fault answered with the wrong action, a numerical fault at a step no
    injection poisoned, a committed checkpoint holding a NaN, the last good one deleted."""
    import torch
    from trainee import Trainee

    import resilient.checkpoint.manager as manager_module
    from chaos.check_numeric import _check_numeric
    from resilient import CheckpointConfig, CheckpointManager
    from resilient.checkpoint.manifest import step_dir

    sc = Scenario(name="h", numeric={"policy": "skip"}, faults=[Fault(kind="bad_batch",
                  rank=1, at_step=9)])  # fmt: skip
    planned = plan(sc)
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(CheckpointConfig(url=str(root), async_save=False, keep_last=5))
    t = Trainee(0)
    for step in (4, 8):
        t.train(1, seed=step)
        mgr.save(t.state(), step)
    mgr.note_numerical_fault(9, rank=1)
    # an older resilient, or a broken check, commits a NaN: the checker loads and finds it
    monkeypatch.setattr(manager_module, "check_agreed", lambda *a, **k: 0.0)
    with torch.no_grad():
        t.model[0].weight[0, 0] = float("nan")
    mgr.save(t.state(), 12)
    mgr.close()

    def ev(event: str, **kw) -> dict:
        return {"event": event, **kw}

    commits = [ev("ckpt.save.committed", step=s) for s in (4, 8, 12)]
    good = [
        ev("numeric.fault", step=9, action="restart", origin=[1]),
        ev("numeric.restart", step=9),
        ev("numeric.fault", step=9, action="skip", origin=[1]),
        ev("numeric.skip", step=9),
    ]
    failures: list[str] = []
    checks = _check_numeric(sc, tmp_path, planned, commits + good, 0, failures)
    assert checks["h_numeric"] == "bad_batch@9: restart -> skip"
    assert checks["h_last_good_kept"] == "pass (checkpoint 8 kept; the first fault at step 9)"
    assert checks["h_finite_checkpoints"].startswith("fail: 3 loaded [4, 8, 12]")
    assert failures == ["h: checkpoint 12 holds non-finite values in ['0.weight']"]

    (root / step_dir(8) / "manifest.json").unlink()  # retention lost the last good one
    wrong = [
        *good[:2],
        ev("numeric.fault", step=9, action="stop", origin=[1]),
        ev("numeric.fault", step=15, action="rollback", origin=[0], seen={"0": ["x"]}),
    ]
    failures = []
    _check_numeric(sc, tmp_path, planned, commits + wrong, 87, failures)
    assert len(failures) == 4, failures
    assert failures[0] == (
        "h: bad_batch at step 9: numeric.fault actions ['restart', 'stop'], expected "
        "['restart', 'skip']"
    )
    assert failures[1].startswith("h: a numerical fault at step 15 that no injection made")
    assert failures[2] == "h: checkpoint 12 holds non-finite values in ['0.weight']"
    assert failures[3].startswith("h: checkpoint 8, the newest before the first numerical fault")


# ---------------------------------------------- silent data corruption: bitflip (issue 27)
def test_a_bitflip_is_expected_at_the_first_replica_check_after_it_and_restarts_cold():
    from chaos.launch import _spec
    from chaos.sdc import check_steps

    assert check_steps(24, 4, 3)[:8] == [3, 4, 6, 8, 9, 12, 15, 16]
    majority = Scenario.load(SCENARIOS / "bitflip_majority.toml")
    rerun = Scenario.load(SCENARIOS / "bitflip_rerun.toml")
    # 13 -> 15 (the interval's check); 6 -> 8 (the save's own check: 6 ran before the flip)
    assert [sc.sdc_check_step(sc.faults[0]) for sc in (majority, rerun)] == [15, 8]
    last = Scenario(name="l", numeric={"sdc": True}, faults=[Fault(kind="bitflip", at_step=21)])
    assert last.sdc_check_step(last.faults[0]) == 24  # sdc_every 100: the final save's check
    for hot in (False, True):  # a snapshot may hold the flip: never rolled back in place
        assert expected_recovery(rerun.faults[0], hot=hot) == "cold"
    ((p,),) = [plan(rerun)]
    assert (p.expect, p.restarts) == ("cold", True)
    assert _spec(p) == "--fault=bitflip@rank=0,step=6,phase=forward,restart=0,generation=0"
    flip = {"kind": "bitflip", "at_step": 9}
    for data, message in (
        ({"recipe": "train_fsdp.py", "numeric": {"sdc": True}}, "needs train_ddp.py"),
        ({}, "numeric.sdc = true"),
        ({"nproc": 1, "numeric": {"sdc": True}}, "two ranks or more"),
    ):
        with pytest.raises(ValueError, match=message):
            Scenario.from_dict({"name": "x", **data, "fault": [flip]})
    # every phase, before the save fence too: the save of the last clean check's step is
    # then suspect (chaos/sdc.py): 12 for a flip in 13, none for 6 (the interval's check)
    assert Fault(kind="bitflip", phase="data").phase == "data"
    assert [sc.sdc_last_clean_step(sc.faults[0]) for sc in (majority, rerun)] == [12, 6]


def test_bitflips_have_a_draw_of_their_own_and_repeat_takes_three_ranks(
    monkeypatch: pytest.MonkeyPatch,
):
    import chaos.draw

    mixed = generate(2026, 200, hot_fraction=0.25, hot_lost=True, numeric_fraction=0.1)
    monkeypatch.setattr(chaos.draw, "_BITFLIP_SHARE", 0.0)
    without = generate(2026, 200, hot_fraction=0.25, hot_lost=True, numeric_fraction=0.1)
    flips = [sc for sc in mixed if sc.faults[0].kind == "bitflip"]
    assert len(flips) == 4  # of the seed's 12 numerical draws; the other 196 kept theirs
    assert all(a == b for a, b in zip(mixed, without, strict=True) if a not in flips)
    assert {sc.nproc for sc in flips} == {2, 3}
    for sc in flips:
        f = sc.faults[0]
        assert sc.recipe == "train_ddp.py" and sc.numeric == {"sdc": True, "sdc_every": 3}
        assert f.rank < sc.nproc and f.phase in SDC_PHASES
    assert {sc.faults[0].phase for sc in flips} == {"backward", "data"}  # every phase drawn
    runs = repeated("bitflip", "train_ddp.py", 2, 6, hot=False, nproc=3)
    assert {sc.faults[0].rank for sc in runs} == {0, 1, 2} and all(sc.nproc == 3 for sc in runs)
    assert all(sc.numeric == {"sdc": True, "sdc_every": 3} for sc in runs)


def _sdc_run(
    at: int,
    odd: list[int] | None,
    saved: list[int],
    loaded: int,
    suspect: list[int] | None = None,
    *,
    committed: bool = False,
) -> list[dict]:
    """Rank 0's events of a two-attempt run whose replica check saw a flip at step `at`,
    naming `suspect` (default: the last of `saved`); `committed`: every save committed, the
    restart skips the suspect ones and the replay replaces them."""

    def ev(event: str, **kw) -> dict:
        return {"event": event, **kw}

    suspect = saved[-1:] if suspect is None else suspect
    return [
        ev("runtime.init", generation=0),
        *(ev("ckpt.save.start", step=s) for s in saved),
        *(ev("ckpt.save.committed", step=s) for s in (saved if committed else ())),
        ev("numeric.sdc", step=at, fingerprints=[7, 7, 9], odd_ranks=odd, suspect=suspect),
        ev("numeric.fault", step=at, ranks=odd or [0, 1, 2], phase="replica check"),
        ev("runtime.init", generation=0),
        *([ev("ckpt.suspect_skipped", steps=suspect)] if committed and suspect else []),
        ev("ckpt.load", step=loaded),
        *(
            ev("ckpt.save.replace_invalid", dir=f"step_{s:09d}")
            for s in (suspect if committed else ())
        ),
        ev("ckpt.save.committed", step=16),
        ev("runtime.done", step=24),
    ]


def test_the_sdc_check_fails_a_late_check_a_wrong_rank_a_late_save_and_a_late_restart(
    tmp_path: Path,
):
    """(h) for a bitflip can fail, and (f) leaves out the steps run on a corrupted replica."""
    from chaos.check_sdc import _check_sdc
    from chaos.replay_check import check_replay

    sc = Scenario.load(SCENARIOS / "bitflip_majority.toml")  # rank 2 at 13: seen at 15
    planned = plan(sc)
    failures: list[str] = []
    # save 12 started after the clean check at 12: suspect, skipped, the restart from 8
    said = _check_sdc(sc, planned, _sdc_run(15, [2], [4, 8, 12], 8, committed=True), failures)
    assert failures == [] and said.startswith("bitflip@13 rank 2: seen at 15 (odd [2]")
    assert "suspect [12] (last clean check 12), skipped [12], restart from 8, replaced [12]" in said
    _check_sdc(sc, planned, _sdc_run(16, [1], [12, 16], 16), failures)
    assert [f.split(": ", 2)[2].split()[0] for f in failures] == ["0", "saves", "the"]
    assert "expected one in attempt 0" in failures[0] and "[16]" in failures[1]
    failures = []
    _check_sdc(sc, planned, _sdc_run(15, [1], [12], 8), failures)
    assert failures == [
        "h: bitflip at step 13 on rank 2: numeric.sdc odd_ranks [1] of fingerprints [7, 7, 9], "
        "expected [2] of 3",
        "h: bitflip at step 13 on rank 2: numeric.fault at 15 in phase 'replica check' named "
        "ranks [1], expected 'replica check' and [2]",
    ]
    # save 12 suspect: its naming, its skip, the load below it and its replacement can fail
    failures = []
    run = _sdc_run(15, [2], [4, 8, 12], 12, suspect=[], committed=True)
    _check_sdc(sc, planned, run, failures)
    assert [f.split(": ", 2)[2].split(" (")[0] for f in failures] == [
        "numeric.sdc at 15 named suspect saves [], expected [12]",
        "the restart skipped suspect checkpoints []",
        "the restart loaded 12, expected a checkpoint of a step <= 11",
        "the replay's saves of suspect steps [12] did not replace them",
        "loaded suspect checkpoint 12, committed before the fault, never saved again",
    ]
    logs = tmp_path / "logs"
    logs.mkdir()
    fp = {"event": "step.fingerprint", "inputs": "h", "world": 3}
    lines = [
        {"event": "runtime.init", "generation": 0},
        *({**fp, "step": s, "loss": 1.0} for s in range(12, 15)),
        {"event": "runtime.init", "generation": 0},
        {"event": "runtime.resume", "step": 12, "from_checkpoint": True},
        *({**fp, "step": s, "loss": 1.0 if s < 14 else 2.0} for s in range(12, 16)),
        {"event": "resume.diverged", "step": 14, "rank": 2, "differed": "loss"},
    ]
    (logs / "rank2.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert len(check_replay(tmp_path)[1]) == 2  # without the window: both differences fail
    status, failures = check_replay(tmp_path, {0: range(13, 15)})
    assert failures == [] and "resume.diverged there as expected: rank 2 at 14" in status
