"""Numerical faults (issue 27): detection agreed by every rank, and the response.

The rules in milliseconds (the decision, the replica fingerprint, the options); then real
2- and 3-rank runs of the recipes under `resilient run` on gloo, with the faults of
chaos/faults.py: a NaN loss and a loss spike rolled back in place, a NaN rolled back cold
without snapshots, a batch that fails every time (stop with exit code 87, or skip), a bit
flipped in one DDP replica. Each run is compared bit for bit with the fault-free run (or with
the run that skips the same step).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import WORKERS, Launcher, free_port, run_cmd, run_events

from resilient.errors import ConfigError
from resilient.exitcodes import ExitCode
from resilient.numeric.config import NumericConfig
from resilient.numeric.detect import NumericWatch
from resilient.numeric.replicas import disagreeing, odd_ranks, replica_fingerprint
from resilient.numeric.respond import RESTART, ROLLBACK, SKIP, STOP, decide
from resilient.runtime.config import build_config

# ------------------------------------------------------------------ rules, no processes


def test_the_response_rule() -> None:
    one = {"policy": "stop", "skips_used": 0, "max_skips": 2}
    assert decide(times_seen=1, can_roll_back=True, **one) == ROLLBACK
    assert decide(times_seen=1, can_roll_back=False, **one) == RESTART
    assert decide(times_seen=2, can_roll_back=True, **one) == STOP
    skip = {**one, "policy": "skip"}
    assert decide(times_seen=2, can_roll_back=True, **skip) == SKIP
    assert decide(times_seen=2, can_roll_back=True, **{**skip, "skips_used": 2}) == STOP


def test_a_flipped_bit_changes_the_replica_fingerprint() -> None:
    model = torch.nn.Linear(8, 4)
    before = replica_fingerprint(model)
    with torch.no_grad():
        model.weight.view(-1).view(torch.int32)[5] ^= 1 << 3
    assert replica_fingerprint(model) != before
    assert odd_ranks([7, 7, 9]) == [2]
    assert odd_ranks([7, 9]) is None  # two ranks: no majority names one
    assert odd_ranks([7, 7, 7, 9]) == [3]


def test_hsdp_replicas_are_compared_within_each_replicate_group() -> None:
    # 2 x 2 HSDP: ranks {0, 2} hold one shard, {1, 3} the other; shards differ by design
    groups = [[0, 2], [1, 3]]
    assert disagreeing([5, 8, 5, 8], groups) == []
    assert disagreeing([5, 8, 6, 8], groups) == [0, 2]
    assert odd_ranks([5, 8, 6, 8], groups) is None  # two replicas: which one is unknown
    three = [[0, 2, 4], [1, 3, 5]]  # 3 x 2: a majority in each group
    assert odd_ranks([5, 8, 5, 9, 5, 8], three) == [3]


def test_bad_options_say_what_is_valid(tmp_path: Path) -> None:
    for bad, match in (
        ({"spike_factor": 0}, "spike_factor must be > 1"),
        ({"spike_window": -1}, "spike_window must be >= 1"),
        ({"policy": "ignore"}, "policy must be one of"),
        ({"max_skips": -1}, "max_skips must be >= 0"),
        ({"colour": 1}, "unknown numeric option"),
    ):
        with pytest.raises(ConfigError, match=match):
            build_config(tmp_path, {"numeric": bad})
    with pytest.raises(ConfigError, match="turn snapshots on"):
        build_config(
            tmp_path, {"numeric": {"policy": "skip"}, "save_every_steps": None}
        )  # skip needs something to replay from


def test_one_process_catches_a_nan_gradient_before_the_optimizer_changes_anything() -> None:
    ctx = SimpleNamespace(distributed=False, world_size=1, rank=0, control_group=None)
    watch = NumericWatch(NumericConfig(), ctx)  # type: ignore[arg-type]
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    watch.attach(opt)
    before = [p.detach().clone() for p in model.parameters()]
    watch.begin(3)
    loss = model(torch.ones(1, 4)).sum() * math.nan
    loss.backward()
    watch.observe_loss(loss)
    opt.step()
    fault = watch.end_step()
    assert fault is not None and fault.step == 3 and fault.origin == [0]
    assert fault.seen[0] == ["loss non-finite", "gradient non-finite"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not opt.state  # AdamW never stepped
    with pytest.raises(ValueError, match="scalar loss"):
        watch.begin(4)
        watch.observe_loss(torch.ones(3))


def test_the_loss_hook_carries_a_bad_loss_into_the_gradients_from_any_kind_of_loss() -> None:
    """The hook that carries a bad loss into the gradients (for DDP's all-reduce to take to
    every rank) sits on the node that made the loss: it must follow the loss when that node
    has several outputs (the loss the second of them), and when the loss is a leaf."""
    ctx = SimpleNamespace(distributed=False, world_size=1, rank=0, control_group=None)
    watch = NumericWatch(NumericConfig(), ctx)  # type: ignore[arg-type]
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch.attach(opt, replicated=True)
    watch.begin(0)
    watch.observe_loss(math.nan)  # the step's loss so far is NaN: what follows must carry it
    _, second = model(torch.ones(2, 4)).reshape(2).unbind()
    watch.observe_loss(second)
    second.backward()
    assert model.weight.grad is not None and bool(model.weight.grad.isnan().all())
    opt.step()
    fault = watch.end_step()
    assert fault is not None and "gradient non-finite" in fault.seen[0]
    leaf = torch.tensor(2.0, requires_grad=True)
    watch.begin(1)
    watch.observe_loss(torch.tensor(math.inf))
    watch.observe_loss(leaf)
    leaf.backward()
    assert leaf.grad is not None and bool(leaf.grad.isnan())
    # a finite loss leaves every gradient bit as it is, through the same nodes
    watch.begin(2)
    model.zero_grad(set_to_none=True)
    _, second = model(torch.ones(2, 4)).reshape(2).unbind()
    watch.observe_loss(second)
    second.backward()
    assert torch.equal(model.weight.grad, torch.ones(1, 4))


def test_a_norm_the_loop_computed_stands_in_for_the_screen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`observe(grad_norm=...)`: the check reads the norm the loop computed (clipping) instead
    of passing over the gradients; a non-finite norm is still confirmed and acted on, a step
    without one (or with a DTensor) is screened, and a wrong shape or type says what to pass."""
    import resilient.numeric.detect as detect

    ctx = SimpleNamespace(distributed=False, world_size=1, rank=0, control_group=None)
    watch = NumericWatch(NumericConfig(), ctx)  # type: ignore[arg-type]
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch.attach(opt)
    screens: list[int] = []
    real = detect.screen
    monkeypatch.setattr(detect, "screen", lambda g, f=None: screens.append(1) or real(g, f))

    def step(at: int, poison: bool, norm: Any) -> Any:
        model.zero_grad(set_to_none=True)
        watch.begin(at)
        (model(torch.ones(1, 4)).sum() * (math.nan if poison else 1.0)).backward()
        if norm is not None:
            watch.observe_grad_norm(norm(model))
        opt.step()
        return watch.end_step()

    clip = lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)  # noqa: E731
    assert step(0, False, clip) is None and not screens
    before = [p.detach().clone() for p in model.parameters()]
    fault = step(1, True, clip)
    assert fault is not None and fault.seen[0] == ["gradient non-finite"] and not screens
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert step(2, False, lambda m: 0.5) is None and not screens  # a number does too
    assert step(3, True, None) is not None and screens == [1]  # none given: the screen
    with pytest.raises(ValueError, match="total norm"):
        watch.begin(4)
        watch.observe_grad_norm(torch.ones(2))
    with pytest.raises(TypeError, match="grad_norm"):
        watch.observe_grad_norm("1.0")


def test_a_parameter_the_optimizer_gains_later_is_screened_too() -> None:
    """The watch walks the optimizer's parameters again only when its groups change: a group
    added, and a group's list replaced by another of the same length, are both seen."""
    ctx = SimpleNamespace(distributed=False, world_size=1, rank=0, control_group=None)
    watch = NumericWatch(NumericConfig(), ctx)  # type: ignore[arg-type]
    a, b, c = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    opt = torch.optim.SGD([a], lr=0.1)
    watch.attach(opt)

    def step_with_nan_in(p: torch.nn.Parameter, step: int) -> Any:
        for q in (a, b, c):
            q.grad = torch.zeros(2)
        p.grad = torch.tensor([0.0, math.nan])
        watch.begin(step)
        opt.step()
        return watch.end_step()

    assert step_with_nan_in(b, 0) is None  # b is not the optimizer's yet
    opt.add_param_group({"params": [b]})
    assert step_with_nan_in(b, 1) is not None
    opt.param_groups[0]["params"] = [c]  # the same length, another list
    assert step_with_nan_in(c, 2) is not None


def test_the_screen_finds_every_kind_of_non_finite_and_changes_no_bit() -> None:
    """One call over every gradient (the op GradScaler uses, numeric/_torch_compat.py); a mix
    of dtypes, and a layout that op refuses (sparse), are still screened, and no gradient
    bit changes (subnormals and -0.0 included)."""
    from resilient.numeric.screen import screen

    def fresh() -> list[torch.Tensor]:
        return [
            torch.tensor([1e-45, -0.0, 3.0]),
            torch.randn(64),
            torch.randn(8, 8).bfloat16(),
            torch.randn(5, dtype=torch.float64),
        ]

    grads = fresh()
    bits = [g.clone() for g in grads]
    assert float(screen(grads)) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(grads, bits, strict=True))
    assert torch.equal(grads[0].view(torch.int32), bits[0].view(torch.int32))  # -0.0, 1e-45
    for index, where, bad in [(1, 7, math.nan), (2, 3, -math.inf), (3, 0, math.inf)]:
        grads = fresh()
        grads[index].view(-1)[where] = bad
        got = float(screen(grads))
        assert got != 0.0, (index, bad)  # positive, or NaN
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, math.nan], (4,), check_invariants=True)
    assert float(screen([torch.randn(3), sparse])) != 0.0
    assert (
        float(
            screen(
                [torch.randn(3), torch.sparse_coo_tensor([[0]], [1.0], (4,), check_invariants=True)]
            )
        )
        == 0.0
    )


# ------------------------------------------------------------------ the agreement's messages


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_ddp_agrees_inside_the_gradient_all_reduce_and_a_spike_never_reaches_the_weights(
    tmp_path: Path, launcher: Launcher
) -> None:
    """3 ranks (tests/workers/numeric_agree.py): with the loss observed before its backward,
    a DDP step's checks send no message of their own; observed after it, or under FSDP2,
    one all-reduce of one number a step. Rank 0's loss spikes at step 6 in each: every rank
    agrees on it, names rank 0 alone, and the step changes no weight. Rank 1's NaN gradient
    under a finite loss at step 8 is found by every rank and changes no weight either. The
    screen changes no gradient bit: a twin without a watch ends every step with the same
    weights."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           str(WORKERS / "numeric_agree.py"), f"--out={tmp_path}"]  # fmt: skip
    rc, stdout, stderr = launcher.run(cmd, timeout=140)
    assert rc == 0, stdout[-2000:] + stderr[-6000:]
    expected = {"ddp_observed_first": 0, "ddp_observed_late": 1, "fsdp2": 1}
    every = ["gradient non-finite"]
    for rank in (0, 1, 2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for variant, messages in expected.items():
            v = got[variant]
            assert v["quiet_collectives"] == [messages] * 7, (rank, variant, v)
            assert v["faults"] == [
                {"step": 6, "ranks": [0], "seen": {"0": ["loss spike"]}},
                {"step": 8, "ranks": [0, 1, 2], "seen": {"0": every, "1": every, "2": every}},
            ], (rank, variant)
            assert v["faulty_steps_changed"] == [False, False], (rank, variant)
        assert got["ddp_observed_first"]["twin_equal"] == [True] * 9, rank


# ------------------------------------------------------------------ real runs

STEPS = 14
SNAPSHOTS = {"RESILIENT_SNAPSHOT": '{"enabled": true, "every_steps": 1}'}
SPIKES = {"spike_factor": 5, "spike_window": 3}


def _run(
    launcher: Launcher,
    out: Path,
    faults: list[str],
    *,
    recipe: str = "train_ddp.py",
    nproc: int = 2,
    numeric: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """The recipe under `resilient run` (3 restarts), faults armed by chaos.inject."""
    specs = [a for f in ["slow@rank=0,step=999,seconds=0", *faults] for a in ("--fault", f)]
    cmd = run_cmd(
        "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=3",
        "--monitor-interval=0.1", f"--run-dir={out / 'run'}", "--restart-backoff=0.1",
        "--restart-jitter=0", "-m", "chaos.inject", *specs, "--",
        f"recipes/{recipe}", "--steps", str(STEPS), "--save-every", "4", "--log-every", "1",
        "--corpus-chars", "20000", "--batch-size", "8",
        "--ckpt-dir", str(out / "ckpt"), "--run-dir", str(out / "run"),
    )  # fmt: skip
    full_env = {**(env or {}), "RESILIENT_NUMERIC": json.dumps(numeric or {})}
    code, stdout, stderr = launcher.run(cmd, timeout=180, env=full_env)
    if code not in (0, int(ExitCode.NUMERICAL_FAULT)):
        pytest.fail(f"rc={code}\n{stdout[-2000:]}\n{stderr[-6000:]}")
    return code


def _digest(out: Path) -> str:
    return str(json.loads((out / "run" / "final_digest.json").read_text())["digest"])


def _faults(out: Path) -> list[dict[str, Any]]:
    return [e for e in run_events(out / "run", "numeric.fault") if e.get("rank") == 0]


@pytest.fixture
def launcher() -> Any:
    launcher = Launcher()
    yield launcher
    launcher.close()


@pytest.fixture(scope="module")
def golden_ddp(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The fault-free DDP run (snapshots and spike checks change no bit of it)."""
    out = tmp_path_factory.mktemp("golden_ddp")
    launcher = Launcher()
    try:
        assert _run(launcher, out, []) == 0
    finally:
        launcher.close()
    return _digest(out)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_nan_and_a_spike_roll_back_in_place_bit_for_bit(
    golden_ddp: str, launcher: Launcher, tmp_path: Path
) -> None:
    faults = ["nan@rank=1,step=5,phase=forward", "spike@rank=0,step=9,phase=forward,factor=50"]
    assert _run(launcher, tmp_path, faults, numeric=SPIKES, env=SNAPSHOTS) == 0
    assert _digest(tmp_path) == golden_ddp
    got = [(e["step"], e["origin"], e["action"]) for e in _faults(tmp_path)]
    assert got == [(5, [1], "rollback"), (9, [0], "rollback")]
    spike = _faults(tmp_path)[1]
    assert spike["seen"] == {"0": ["loss spike"]} and spike["threshold"]["0"] > 0
    transient = run_events(tmp_path / "run", "numeric.transient")
    assert sorted({(e["step"], tuple(e["ranks"])) for e in transient}) == [(5, (1,)), (9, (0,))]
    assert not run_events(tmp_path / "run", "numeric.restart")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_without_snapshots_a_nan_restarts_cold_bit_for_bit(
    golden_ddp: str, launcher: Launcher, tmp_path: Path
) -> None:
    assert _run(launcher, tmp_path, ["nan@rank=0,step=6,phase=forward"]) == 0
    assert _digest(tmp_path) == golden_ddp
    restarts = run_events(tmp_path / "run", "numeric.restart")
    assert restarts and "snapshots are off" in restarts[0]["reason"]
    assert [e["action"] for e in _faults(tmp_path)] == ["restart"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_batch_that_always_fails_stops_the_run_and_keeps_every_good_checkpoint(
    launcher: Launcher, tmp_path: Path
) -> None:
    code = _run(launcher, tmp_path, ["bad_batch@rank=1,step=9,phase=forward"], env=SNAPSHOTS)
    assert code == ExitCode.NUMERICAL_FAULT
    faults = _faults(tmp_path)
    assert [(e["step"], e["action"], e["times_seen"]) for e in faults] == [
        (9, "rollback", 1),
        (9, "stop", 2),
    ]
    assert faults[-1]["origin"] == [1]
    assert {k: faults[-1]["batch"][k] for k in ("epoch", "batch")} == {"epoch": 0, "batch": 9}
    samples = faults[-1]["batch"]["samples"]  # the dataset indices: the sampler can tell
    assert len(set(samples)) == 8 and faults[0]["batch"]["samples"] == samples  # same inputs
    committed = sorted(p.parent.name for p in (tmp_path / "ckpt").glob("step_*/manifest.json"))
    assert committed == ["step_000000004", "step_000000008"]  # nothing after the fault
    inits = [e for e in run_events(tmp_path / "run", "runtime.init") if e["rank"] == 0]
    assert len(inits) == 1  # exit code 87: never restarted


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_skips_a_bad_batch_exactly_as_a_run_told_to_skip_it(
    launcher: Launcher, tmp_path: Path
) -> None:
    skip = {"policy": "skip"}
    code = _run(
        launcher, tmp_path / "faulty", ["bad_batch@rank=0,step=7,phase=forward"],
        recipe="train_fsdp.py", numeric=skip, env=SNAPSHOTS,
    )  # fmt: skip
    assert code == 0
    told = {"skip_steps": [7]}
    assert _run(launcher, tmp_path / "told", [], recipe="train_fsdp.py", numeric=told) == 0
    assert _digest(tmp_path / "faulty") == _digest(tmp_path / "told")
    skips = run_events(tmp_path / "faulty" / "run", "numeric.skip")
    assert {e["step"] for e in skips} == {7}


@pytest.mark.extended  # three ranks, two runs and a restart: make soak (CI's budget)
@pytest.mark.timeout(300)
def test_a_bit_flipped_in_one_of_three_replicas_is_named_and_undone(
    launcher: Launcher, tmp_path: Path
) -> None:
    sdc = {"sdc": True, "sdc_every": 2}
    assert _run(launcher, tmp_path / "golden", [], nproc=3, numeric=sdc) == 0
    flip = ["bitflip@rank=2,step=6,phase=optimizer"]
    assert _run(launcher, tmp_path / "faulty", flip, nproc=3, numeric=sdc) == 0
    assert _digest(tmp_path / "faulty") == _digest(tmp_path / "golden")
    sdc_events = [e for e in run_events(tmp_path / "faulty" / "run", "numeric.sdc")]
    assert {e["step"] for e in sdc_events} == {8} and sdc_events[0]["odd_ranks"] == [2]
    loads = run_events(tmp_path / "faulty" / "run", "ckpt.load")
    assert {e["step"] for e in loads} == {4}  # the newest checkpoint, checked at its save


@pytest.mark.slow
@pytest.mark.timeout(240)
# make soak: whether save 8 commits before the restart is a race (failed in 3 of 5 full
# suites on 2026-11-27, on forked and on new interpreters), and without that commit there
# is no suspect checkpoint to skip, which is what the test is about
@pytest.mark.extended
def test_a_bit_flipped_while_an_async_save_copies_never_comes_back_from_that_checkpoint(
    golden_ddp: str, launcher: Launcher, tmp_path: Path
) -> None:
    """A flip in the next step's data phase lands while save 8's staging copy may still read
    the tensors: the check before the save passed, so the copy may hold the flip (it did in
    4 of 6 runs before the fix, and the run ended 0 with other bits). The mismatch at 9 makes
    checkpoint 8 suspect: the restart loads 4, and the replay's save of 8 replaces it."""
    flip = ["bitflip@rank=0,step=8,phase=data"]
    assert _run(launcher, tmp_path, flip, numeric={"sdc": True, "sdc_every": 3}) == 0
    assert _digest(tmp_path) == golden_ddp
    sdc = run_events(tmp_path / "run", "numeric.sdc")
    assert {(e["step"], tuple(e["suspect"])) for e in sdc} == {(9, (8,))}
    skipped = run_events(tmp_path / "run", "ckpt.suspect_skipped")
    assert skipped and all(e["steps"] == [8] for e in skipped)
    assert {e["step"] for e in run_events(tmp_path / "run", "ckpt.load")} == {4}
    replaced = {e["dir"] for e in run_events(tmp_path / "run", "ckpt.save.replace_invalid")}
    assert replaced == {"step_000000008"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_reruns_a_sampled_step_and_a_bit_flipped_in_its_first_run_is_undone(
    launcher: Launcher, tmp_path: Path
) -> None:
    """FSDP2 holds no replica: a sampled step runs twice from its snapshot; a bit flipped in
    the first run makes the two differ, and the run restarts from the newest checkpoint."""
    rerun = {"rerun": True, "rerun_every": 4}
    assert _run(launcher, tmp_path / "golden", [], recipe="train_fsdp.py") == 0
    flip = ["bitflip@rank=0,step=8,phase=optimizer"]
    code = _run(
        launcher, tmp_path / "faulty", flip, recipe="train_fsdp.py", numeric=rerun, env=SNAPSHOTS
    )
    assert code == 0
    assert _digest(tmp_path / "faulty") == _digest(tmp_path / "golden")
    differs = run_events(tmp_path / "faulty" / "run", "numeric.rerun.differs")
    assert {(e["step"], tuple(e["ranks"])) for e in differs} == {(8, (0,))}
    equal = {e["step"] for e in run_events(tmp_path / "faulty" / "run", "numeric.rerun.equal")}
    assert {4, 8, 12} <= equal  # 8 again after the restart, clean
    assert [e["action"] for e in _faults(tmp_path / "faulty")] == ["restart"]
