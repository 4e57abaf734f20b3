"""Pipeline-parallel jobs (issue 37): stages checkpointed by global names, resumed exactly.

Real `resilient run` launches of tests/workers/pipeline_train.py on gloo: an `nn.Sequential`
of 4 `nn.Linear` layers split over pipeline stages (torch.distributed.pipelining, GPipe or
1F1B), each stage keeping the model's names and holding only its own layers.

- Stages that name their layers 0.. (the naive split) lose half the model at every save
  under DCP: the save is refused before anything is written, with exit 80 (MISMATCH), and the
  supervisor does not restart it.
- A kill -9 of a stage rank, cold: the run ends bit for bit equal to the fault-free run.
- A PP=2 checkpoint resumes at PP=1 on the exact sample, and a PP=1 one back at PP=2;
  `resilient export` and `resilient.load_model` give the whole model from a PP=2 checkpoint;
  a model that lacks one of its layers is refused with the layer named, exit 80 at once.
The pure rules (fingerprints, the optimizer's format) run in milliseconds below.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import Launcher, last_by_step, records, run_cmd, run_events, run_rank0_exits
from torch import nn

from resilient.checkpoint.duplicates import divergent, fingerprints
from resilient.checkpoint.loading import flat_optim
from resilient.exitcodes import ExitCode

WORKER = "tests/workers/pipeline_train.py"
WATCHDOG = {"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 5.0, "timeout_s": 30.0}
BATCH = 8


# ---------------------------------------------------------------------- pure rules
@pytest.mark.timeout(30)
def test_fingerprints_tell_one_value_from_another_under_one_name() -> None:
    w = torch.randn(4, 4)
    same = {"model": {"0.weight": w.clone(), "0.bias": torch.zeros(4)}, "optim": {"lr": 0.1}}
    other = {"model": {"0.weight": w.clone(), "0.bias": torch.zeros(4)}, "optim": {"lr": 0.1}}
    assert divergent([fingerprints(same), fingerprints(other)]) == {}
    other["model"]["0.weight"][2, 3] = torch.nextafter(w[2, 3], torch.tensor(9.0))  # one ulp
    other["optim"]["lr"] = 0.2
    assert divergent([fingerprints(same), fingerprints(other)]) == {
        "model.0.weight": [0, 1],
        "optim.lr": [0, 1],
    }
    # a key only one rank holds (another stage's layer) is no conflict; left-out keys neither
    third = {"model": {"2.weight": torch.ones(2)}}
    assert divergent([fingerprints(same), fingerprints(third)]) == {}
    skip = frozenset({"model.0.weight", "optim.lr"})
    assert divergent([fingerprints(same, skip), fingerprints(other, skip)]) == {}


@pytest.mark.timeout(30)
def test_dtensors_are_left_to_dcp_and_plain_leaves_of_every_dtype_are_compared() -> None:
    for t in (torch.arange(6), torch.ones(3, dtype=torch.bfloat16), torch.tensor([True])):
        a, b = {"model": {"t": t}}, {"model": {"t": t.clone()}}
        assert divergent([fingerprints(a), fingerprints(b)]) == {}
        b["model"]["t"] = torch.zeros_like(t)
        assert list(divergent([fingerprints(a), fingerprints(b)])) == ["model.t"]


@pytest.mark.timeout(30)
def test_the_optimizer_format_is_read_from_the_checkpoint_keys() -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model = nn.Sequential(nn.Linear(2, 2), nn.Identity(), nn.Linear(2, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    for flat in (False, True):
        msd, osd = get_state_dict(
            model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flat)
        )
        keys, _ = flatten_state_dict({"model": msd, "optim": osd})
        assert flat_optim(dict.fromkeys(keys)) is flat


@pytest.mark.timeout(30)
def test_mismatch_has_its_exit_code_and_row() -> None:
    assert int(ExitCode.MISMATCH) == 80
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert "| 80 |" in readme


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_mismatch_is_neither_restarted_nor_replaced_hot(
    tmp_path: Path, launcher: Launcher
) -> None:
    """Rank 0 exits 80 after init under --hot-recovery: no hot replacement, no restart."""
    # a warm spare and two workers start: torch imported three times
    code, err, run_dir, starts = run_rank0_exits(launcher, tmp_path, 80, hot=True, timeout=200)
    assert code == ExitCode.MISMATCH, err[-3000:]
    assert starts == ["rank 0 attempt 0", "rank 1 attempt 0"]
    report = json.loads((run_dir / "supervisor_report.json").read_text())
    assert (report["outcome"], report["exit_code"]) == ("mismatch", 80)
    assert [a["action"] for a in report["attempts"]] == ["stop: mismatch"]
    assert run_events(run_dir, "restart.decided") == []
    assert run_events(run_dir, "recovery.hot.replace") == []
    assert "resilient run: mismatch, exit code 80 (MISMATCH)" in err


# ---------------------------------------------------------------------- end to end
def _launch(
    launcher: Launcher,
    out: Path,
    nproc: int,
    *args: str,
    faults: tuple[str, ...] = (),
    restarts: int = 0,
    code: int = 0,
    env: dict[str, str] | None = None,
    hot: bool = False,
) -> str:
    argv = [
        f"--nproc-per-node={nproc}",
        f"--max-restarts={restarts}",
        f"--run-dir={out / 'run'}",
        f"--checkpoint-url={out / 'ckpt'}",
    ]
    if hot:  # a snapshot every step: a kill loses at most the step it interrupted
        argv += ["--hot-recovery", "--monitor-interval=0.05"]
        env = {"RESILIENT_SNAPSHOT": json.dumps({"enabled": True, "every_steps": 1}), **(env or {})}
    if faults:
        argv += ["-m", "chaos.inject", *[a for f in faults for a in ("--fault", f)], "--"]
    argv += [WORKER, f"--record={out / 'rec'}", f"--batch={BATCH}", *args]
    got, stdout, err = launcher.run(
        # 15-40 s on a quiet machine; the bound is for a hang (a restart starts torch twice,
        # which took minutes on the 2-core VM shared by six jobs)
        run_cmd(*argv),
        timeout=420,
        env={"RESILIENT_WATCHDOG": json.dumps(WATCHDOG), **(env or {})},
    )
    assert got == code, (stdout[-2000:], err[-4000:])
    return err


_GOLD: dict[tuple[object, ...], Path] = {}


def _gold(factory: pytest.TempPathFactory, launcher: Launcher, *args: str, nproc: int = 2) -> Path:
    """The fault-free run of `args` on `nproc` ranks, launched once per session (tests share
    it)."""
    if (nproc, *args) not in _GOLD:
        out = factory.mktemp("gold")
        _launch(launcher, out, nproc, *args)
        _GOLD[(nproc, *args)] = out
    return _GOLD[(nproc, *args)]


def _digests(out: Path) -> dict[int, str]:
    return {
        int(f.stem.removeprefix("final_rank")): json.loads(f.read_text())["digest"]
        for f in (out / "rec").glob("final_rank*.json")
    }


def _order(n: int = 512) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stages_that_name_their_layers_alike_are_refused_before_any_save(
    tmp_path: Path, launcher: Launcher
) -> None:
    """The issue's silent loss: both stages call their layers 0.weight, 0.bias, ... and no
    mesh says they are stages. The first save is refused on every rank, nothing is written,
    and `resilient run` stops with 80 instead of restarting the same refusal."""
    err = _launch(
        launcher,
        tmp_path,
        2,
        "--local-names",
        "--no-mesh",
        "--steps=6",
        restarts=2,
        code=int(ExitCode.MISMATCH),
    )
    assert "ranks hold different values under the same name" in err
    refused = run_events(tmp_path / "run", "ckpt.save.divergent")
    assert refused and "model.0.weight" in refused[0]["first"], refused
    assert not list((tmp_path / "ckpt").glob("step_*/manifest.json"))  # nothing committed
    assert not run_events(tmp_path / "run", "restart.decided")  # stopped, not restarted
    assert run_events(tmp_path / "run", "restart.mismatch")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_pipeline_without_a_mesh_is_refused_at_track_with_the_fix_first(
    tmp_path: Path, launcher: Launcher
) -> None:
    """Issue 49: a 1F1B loop on 2 stages with global names and no DeviceMesh, as torch's
    pipelining tutorial writes it. track() sees disjoint parameter names on the two ranks and
    refuses before step 0, the fix first; exit 80, not restarted, nothing trained or saved."""
    err = _launch(
        launcher, tmp_path, 2, "--no-mesh", "--steps=6", restarts=2, code=int(ExitCode.MISMATCH)
    )
    assert "ConfigError: pass mesh= with a 'pp' dimension to track()" in err, err[-3000:]
    assert "rank 0: 4 such as '0.bias'" in err and "rank 1: 4 such as" in err
    run = tmp_path / "run"
    assert not run_events(run, "train.progress") and not run_events(run, "step.fingerprint")
    assert not run_events(run, "ckpt.save.start") and not run_events(run, "runtime.resume")
    assert not list((tmp_path / "ckpt").glob("step_*"))
    assert not run_events(run, "restart.decided")  # stopped, not restarted
    assert run_events(run, "restart.mismatch")


@pytest.mark.timeout(30)
def test_a_save_refusal_never_leads_with_advice_the_loop_already_follows() -> None:
    from resilient.checkpoint.duplicates import refusal

    groups = refusal(20, {"optim.param_groups.0.params": [0, 1]})
    assert groups.startswith("Pass the world mesh with a 'pp' dimension to track(mesh=...)")
    assert "Give each rank's distinct state its own name" not in groups
    names = refusal(20, {"model.0.weight": [0, 1], "optim.param_groups.0.params": [0, 1]})
    assert names.startswith("step 20: ranks hold different values under the same name")
    assert names.index("its own name") < names.index("'pp' dimension")
    assert "'pp'" not in refusal(3, {"model.0.weight": [0, 1]})


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("gpipe", marks=pytest.mark.extended)])
def test_a_killed_stage_rank_resumes_cold_bit_for_bit(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, launcher: Launcher, schedule: str
) -> None:
    common = ("--steps=12", "--save-every=4", f"--schedule={schedule}")
    gold_dir = _gold(tmp_path_factory, launcher, *common)
    _launch(
        launcher,
        tmp_path / "kill",
        2,
        *common,
        faults=("kill@rank=1,step=10,phase=forward",),
        restarts=1,
    )
    gold, kill = _digests(gold_dir), _digests(tmp_path / "kill")
    assert sorted(gold) == [0, 1] and gold == kill
    assert len({r["attempt"] for r in records(tmp_path / "kill" / "rec")}) == 2  # it restarted
    loads = run_events(tmp_path / "kill" / "run", "ckpt.load")  # from a stages' checkpoint
    assert {e["rank"] for e in loads} == {0, 1} and {e["step"] for e in loads} <= {4, 8}
    # the replayed steps' fingerprints (stage 0: its inputs, stage 1: its received
    # activations and the loss) matched the first attempt's on both stages
    verified = run_events(tmp_path / "kill" / "run", "resume.verified")
    assert {e["rank"] for e in verified} == {0, 1}, verified
    assert not run_events(tmp_path / "kill" / "run", "resume.diverged")

    def losses(out: Path) -> dict[int, list[float]]:
        by_step = last_by_step(records(out / "rec"))
        return {s: [r["loss"] for r in rs if r["loss"] is not None] for s, rs in by_step.items()}

    assert losses(tmp_path / "kill") == losses(gold_dir)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "layout",
    [("--pp=2", "--dp=2"), pytest.param(("--pp=4", "--dp=1"), marks=pytest.mark.extended)],
    ids=["pp2xdp2", "pp4"],
)
def test_four_ranks_resume_cold_bit_for_bit_after_a_kill(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    launcher: Launcher,
    layout: tuple[str, str],
) -> None:
    """pp=2 x dp=2 (DDP over each stage's replicas) and pp=4: rank 2 (stage 0 of the second
    replica, or stage 2) is SIGKILLed at step 10; the cold restart ends bit for bit equal."""
    common = (*layout, "--steps=12", "--save-every=4")
    gold_dir = _gold(tmp_path_factory, launcher, *common, nproc=4)
    _launch(
        launcher,
        tmp_path / "kill",
        4,
        *common,
        faults=("kill@rank=2,step=10,phase=forward",),
        restarts=1,
    )
    gold, kill = _digests(gold_dir), _digests(tmp_path / "kill")
    assert sorted(gold) == [0, 1, 2, 3] and gold == kill
    assert {e["rank"] for e in run_events(tmp_path / "kill" / "run", "ckpt.load")} == {0, 1, 2, 3}
    assert not run_events(tmp_path / "kill" / "run", "resume.diverged")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("layout", "killed", "peer"),
    [
        (("--pp=2", "--dp=1"), 1, None),
        (("--pp=2", "--dp=2"), 3, 1),
        pytest.param(("--pp=4", "--dp=1"), 2, None, marks=pytest.mark.extended),
    ],
    ids=["pp2", "pp2xdp2", "pp4"],
)
def test_a_lost_stage_rank_is_replaced_hot_bit_for_bit(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    launcher: Launcher,
    layout: tuple[str, str],
    killed: int,
    peer: int | None,
) -> None:
    """A stage rank SIGKILLed in its backward under --hot-recovery is replaced hot, in the
    same attempt: the survivors keep their stages, and the run ends bit for bit equal to the
    fault-free one. A stage's state exists on its stage's ranks only, so with one replica
    (pp2, pp4) the replacement restores from its buddy's whole replica of its snapshot; with
    DDP replicas of each stage (pp2xdp2) from its replicate peer's own snapshot (`peer`),
    and no rank keeps a second copy of a stage."""
    common = (*layout, "--steps=12", "--save-every=4")
    pp, dp = (int(flag.split("=")[1]) for flag in layout)
    nproc = pp * dp
    gold_dir = _gold(tmp_path_factory, launcher, *common, nproc=nproc)
    out = tmp_path / "hot"
    fault = f"kill@rank={killed},step=6,phase=backward"
    _launch(launcher, out, nproc, *common, faults=(fault,), hot=True)
    assert _digests(out) == _digests(gold_dir) and len(_digests(out)) == nproc
    assert not run_events(out / "run", "recovery.cold"), "went cold"
    assert len({r["attempt"] for r in records(out / "rec")}) == 1  # no restart
    formed = {int(e["rank"]): e for e in run_events(out / "run", "recovery.hot.formed")}
    assert sorted(formed) == list(range(nproc)), formed
    new = formed[killed]
    assert new["survivor"] is False and new["to_step"] in (5, 6), new
    assert new["from_replicate_peer"] is (peer is not None)
    memory = {(e["copies"], e["replica"]) for e in run_events(out / "run", "snapshot.memory")}
    if peer is None:
        assert memory == {(4, "whole")}, memory  # its own two copies and its ward's two
    else:
        assert new["from_rank"] == peer and memory == {(2, "per-rank part")}, (new, memory)
    # every rank held its stage through the recovery: stage = rank's pp coordinate
    assert {(r["rank"], r["stage"]) for r in records(out / "rec")} == {
        (r, r % pp) for r in range(nproc)
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("hot", [False, True], ids=["cold", "hot"])
def test_interleaved_stages_resume_bit_for_bit_and_say_what_goes_unchecked(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, launcher: Launcher, hot: bool
) -> None:
    """ScheduleInterleaved1F1B: each of 2 ranks runs two virtual stages (layers r and r + 2)
    through modules of its own over the tracked model's layers. A kill -9 of rank 1 ends bit
    for bit equal to the fault-free run, cold (from checkpoint 8) or hot. The tracked
    model's forward never runs, so stage 0's inputs go unfingerprinted: said once, on that
    rank, as `replay.unhooked`; the last stage's losses are still checked on a cold resume."""
    common = ("--steps=12", "--save-every=4", "--schedule=interleaved")
    gold_dir = _gold(tmp_path_factory, launcher, *common)
    out = tmp_path / ("hot" if hot else "cold")
    # the optimizer's phase: the forward's is the tracked model's, which never runs here
    fault = f"kill@rank=1,step={6 if hot else 10},phase=optimizer"
    _launch(launcher, out, 2, *common, faults=(fault,), restarts=0 if hot else 1, hot=hot)
    assert _digests(out) == _digests(gold_dir) and len(_digests(out)) == 2
    unhooked = run_events(out / "run", "replay.unhooked")
    assert unhooked and {e["rank"] for e in unhooked} == {0}, unhooked
    if hot:
        assert not run_events(out / "run", "recovery.cold")
        assert len(run_events(out / "run", "recovery.hot.formed")) == 2
    else:
        assert [e["rank"] for e in run_events(out / "run", "resume.verified")] == [1]
        assert not run_events(out / "run", "resume.diverged")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("hot", [True, pytest.param(False, marks=pytest.mark.extended)])
def test_a_nan_on_the_first_stage_is_rolled_back_bit_for_bit(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, launcher: Launcher, hot: bool
) -> None:
    """Stage 0's forward at step 6 returns NaN once: the loss (stage 1) and both stages'
    gradients follow. The stages agree on it before either optimizer steps and roll back in
    place to the snapshot of step 6 (`hot`), or, snapshots off, restart cold from the
    checkpoint of step 4; either way the run ends bit for bit equal to the fault-free one."""
    common = ("--steps=12", "--save-every=4", "--schedule=1f1b")  # the kill test's gold
    snapshots = {"RESILIENT_SNAPSHOT": '{"enabled": true, "every_steps": 1}'} if hot else {}
    gold = _gold(tmp_path_factory, launcher, *common)
    _launch(
        launcher,
        tmp_path / "nan",
        2,
        *common,
        faults=("nan@rank=0,step=6,phase=forward",),
        restarts=1,
        env=snapshots,
    )
    assert _digests(tmp_path / "nan") == _digests(gold)
    faults = run_events(tmp_path / "nan" / "run", "numeric.fault")
    assert faults and {e["step"] for e in faults} == {6}, faults
    assert {e["action"] for e in faults} == {"rollback" if hot else "restart"}, faults
    assert {e["rank"] for e in faults} == {0, 1}  # both stages saw it, agreed
    restarts = run_events(tmp_path / "nan" / "run", "numeric.restart")
    assert bool(restarts) is not hot, restarts


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_a_nan_on_the_first_stage_with_ddp_in_the_stages_is_rolled_back(
    tmp_path: Path, launcher: Launcher
) -> None:
    """pp=2 x dp=2, DDP over each stage's replicas: rank 0's forward (stage 0) at step 6 is
    NaN once; every rank agrees, rolls back in place and ends bit for bit equal."""
    common = ("--pp=2", "--dp=2", "--steps=10", "--save-every=4")
    snapshots = {"RESILIENT_SNAPSHOT": '{"enabled": true, "every_steps": 1}'}
    _launch(launcher, tmp_path / "gold", 4, *common)
    faults = ("nan@rank=0,step=6,phase=forward",)
    _launch(launcher, tmp_path / "nan", 4, *common, faults=faults, restarts=1, env=snapshots)
    assert _digests(tmp_path / "nan") == _digests(tmp_path / "gold")
    faults_seen = run_events(tmp_path / "nan" / "run", "numeric.fault")
    assert {(e["rank"], e["step"], e["action"]) for e in faults_seen} == {
        (r, 6, "rollback") for r in range(4)
    }, faults_seen


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_micro_batches_that_do_not_divide_the_batch_are_refused(
    tmp_path: Path, launcher: Launcher
) -> None:
    """8 samples in 3 micro-batches (3, 3, 2): every stage refuses the first step before any
    weight changes, exit 80 at once (no restart), the sizes and the fix named."""
    err = _launch(
        launcher,
        tmp_path,
        2,
        "--microbatches=3",
        "--uneven",
        "--steps=4",
        restarts=2,
        code=int(ExitCode.MISMATCH),
    )
    assert "micro-batches of step 0 differ in size ([3, 2] samples)" in err, err[-3000:]
    assert "n_microbatches does not divide the batch" in err
    assert not run_events(tmp_path / "run", "restart.decided")
    assert not list((tmp_path / "rec").glob("rank*.jsonl")) or not any(
        f.read_text().strip() for f in (tmp_path / "rec").glob("rank*.jsonl")
    )  # no step completed


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stopped_stage_is_named_with_its_stage_and_micro_batch(
    tmp_path: Path, launcher: Launcher
) -> None:
    """Stage 0 SIGSTOPs itself entering the forward of micro-batch 0 of step 6 (after a pause
    that lets its heartbeat say so). Its peer, blocked in the schedule's recv, names it from
    its last heartbeat with its stage and the schedule's action, kills it, and leaves."""
    faults = (
        "slow@rank=0,step=6,phase=forward,seconds=1",  # heartbeats carry the new position
        "stop@rank=0,step=6,phase=forward",
    )
    # no restart allowed: the supervisor reports 88 once the peer left with 81 (HANG)
    code = int(ExitCode.RESTARTS_EXHAUSTED)
    _launch(launcher, tmp_path, 2, "--steps=12", faults=faults, code=code)
    (hang,) = run_events(tmp_path / "run", "hang.detected")
    assert hang["kind"] == "no_heartbeat" and hang["ranks"] == [0], hang
    (named,) = hang["named"]
    assert named["state"] == "stopped"
    assert (named["step"], named["stage"], named["phase"]) == (6, 0, "forward"), named
    assert named["action"] == "forward of micro-batch 0", named
    (left,) = run_events(tmp_path / "run", "watchdog.exit")  # the peer, out of its recv
    assert (left["rank"], left["code"], left["ranks"]) == (1, int(ExitCode.HANG), [0]), left
    killed = run_events(tmp_path / "run", "watchdog.killed")
    assert [e["pid"] for e in killed] == [named["pid"]]


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("back", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_a_pp2_checkpoint_resumes_at_pp1_and_back_and_exports_whole(
    tmp_path: Path, launcher: Launcher, back: bool
) -> None:
    """PP=2 to step 4; the whole model from it (export, load_model); a 3-layer model refused
    with the missing layer named; PP=1 on one rank to step 8 on the exact samples; and (`back`,
    extended) PP=2 again to step 12."""
    import resilient
    from resilient.cli import main

    first = tmp_path / "pp2"
    _launch(launcher, first, 2, "--steps=12", "--stop-at=4", "--save-every=4")
    # the whole model, from the stages' checkpoint
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    resilient.load_model(str(first / "ckpt"), model)
    exported = tmp_path / "export"
    assert main(["export", str(first / "ckpt"), "--to", str(exported), "--format", "torch"]) == 0
    whole = torch.load(exported / "model.pt", weights_only=True)["model"]
    assert sorted(whole) == sorted(model.state_dict())
    assert all(torch.equal(whole[k], v) for k, v in model.state_dict().items())

    # a model that lacks one of the checkpoint's layers: named, stopped at once
    short = tmp_path / "short"
    shutil.copytree(first, short)
    err = _launch(launcher, short, 1, "--pp=1", "--layers=3", "--steps=12", restarts=2, code=80)
    assert "3.weight" in err and "layers this model lacks" in err
    assert not run_events(short / "run", "restart.decided")

    # PP=2 -> PP=1 (one rank) to step 8, then PP=1 -> PP=2 to step 12
    _launch(launcher, first, 1, "--pp=1", "--steps=12", "--stop-at=8", "--save-every=4")
    if back:
        _launch(launcher, first, 2, "--pp=2", "--steps=12", "--save-every=4")
    order = _order()
    final = last_by_step(records(first / "rec"))
    assert sorted(final) == list(range(12 if back else 8))
    for step, recs in final.items():
        assert all(r["ids"] == order[step * BATCH : (step + 1) * BATCH] for r in recs), step
    assert {len(final[s]) for s in range(4, 8)} == {1}  # one unsplit rank
    if back:
        assert {len(final[s]) for s in range(8, 12)} == {2}  # two stages again
    load = run_events(first / "run", "ckpt.load.reshard")
    assert load and load[0]["saved_mesh"].endswith("pp=2") and load[0]["bitwise"] is False
