"""Replay verification: step fingerprints, the online check after a resume, the offline checks
(`resilient check-resume`, the chaos invariant) and their place in `resilient report`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from chaos.procs import REPO, Run, torchrun_cmd
from chaos.replay_check import check_replay
from resilient import events as ev
from resilient.replay.compare import across_attempts, compare
from resilient.replay.fingerprint import ReplayCheck, StepFingerprints
from resilient.report import analyze, format_report

GPT = REPO / "tests" / "workers" / "gpt_style.py"


class _Log:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def _add(self, event: str, **fields: Any) -> None:
        self.events.append({"event": event, **fields})

    debug = info = warning = error = _add


def _hash(*values: Any) -> str:
    log = _Log()
    fp = StepFingerprints(log, world=1)
    fp.begin(0)
    fp.inputs(*values)
    fp.end(0)
    return str(log.events[-1]["inputs"])


def test_fingerprint_sees_values_order_dtype_and_shape() -> None:
    x = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    ids = torch.randint(0, 100, (6, 8), generator=torch.Generator().manual_seed(0))
    assert _hash(x, ids) == _hash(x.clone(), ids.clone())
    assert _hash(x, ids) != _hash(x[[1, 0, 2, 3, 4, 5]], ids)  # two samples swapped
    assert _hash(x) != _hash(x.double()) and _hash(x) != _hash(x.reshape(4, 6))
    y = x.clone()
    y[5, 3] = torch.nextafter(y[5, 3], torch.tensor(100.0))  # one ulp
    assert _hash(x) != _hash(y)
    assert _hash({"a": x, "mask": x > 3}, None, 2) != _hash({"a": x, "mask": x > 4}, None, 2)


def test_host_fingerprint_is_the_tensor_sum_it_was() -> None:
    """The host path (Python ints, a dot for 8-byte values) hashes as the tensor path does:
    a resumed run compares its fingerprints with those an earlier attempt logged."""
    g = torch.Generator().manual_seed(0)
    values = [
        torch.randint(-(2**62), 2**62, (4, 32), generator=g),
        torch.randn(6, dtype=torch.float64, generator=g) * 1e300,
        torch.randn(5, dtype=torch.complex64, generator=g),
        torch.ones(7, dtype=torch.bool),
        torch.tensor(124),
    ]
    total = torch.zeros((), dtype=torch.int64)
    for i, v in enumerate(values):
        flat = v.reshape(-1)
        flat = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat
        flat = flat.view(torch.uint8) if flat.dtype == torch.bool else flat
        size = flat.element_size()
        as_int = {4: torch.int32, 8: torch.int64}[size] if flat.is_floating_point() else flat.dtype
        flat = flat.view(as_int)
        w = torch.arange(flat.numel(), dtype=torch.int64) * 0x9E3779B1 * 2 + 1
        w = w if size > 4 else w.to(torch.int32)
        total = total + (flat * w).sum(dtype=torch.int64) * (2 * i + 1)
    fp = StepFingerprints(_Log(), world=1)
    fp.begin(0)
    fp.inputs(*values)
    assert isinstance(fp._hash, int) and (fp._hash - int(total)) % 2**64 == 0


def test_first_forward_of_a_step_and_the_observed_loss_make_the_fingerprint() -> None:
    log = _Log()
    fp = StepFingerprints(log, world=2)
    model = torch.nn.Linear(4, 1)
    fp.attach(model)
    a, b = torch.ones(2, 4), torch.zeros(2, 4)
    model(a)  # outside a step: not recorded
    fp.begin(7)
    model(a)
    model(b)  # the second forward of the step does not count
    fp.observe_loss(torch.tensor(0.25))
    fp.observe_loss(0.5)
    fp.end(7)
    (rec,) = log.events
    assert rec["event"] == ev.STEP_FINGERPRINT and rec["step"] == 7 and rec["world"] == 2
    assert rec["inputs"] == _hash(a) and rec["loss"] == 0.75


def test_online_check_names_the_first_diverging_step_once() -> None:
    earlier = {3: ("aa", 1.0), 4: ("bb", 2.0), 5: ("cc", None)}
    log = _Log()
    check = ReplayCheck(log, dict(earlier), rank=1)
    check.record(3, ("aa", 1.0))
    check.record(4, ("bb", 2.5))
    check.record(5, ("xx", None))
    (div,) = log.events
    assert div["event"] == ev.RESUME_DIVERGED and div["step"] == 4 and div["differed"] == "loss"
    assert "nondeterministic" in div["causes"] and div["matched"] == 1
    log = _Log()
    check = ReplayCheck(log, dict(earlier), rank=0)
    for s, f in earlier.items():
        check.record(s, (f[0], 9.0 if f[1] is None else f[1]))  # a loss on one side only
    assert log.events == [{"event": ev.RESUME_VERIFIED, "steps": 3, "of": 3, "note": None}]


def _fp(step: int, inputs: str, loss: float | None = None) -> dict[str, Any]:
    return {"event": ev.STEP_FINGERPRINT, "step": step, "inputs": inputs, "loss": loss, "world": 2}


def test_across_attempts_compares_each_resume_with_the_newest_earlier_record() -> None:
    init = {"event": ev.RUNTIME_INIT}
    log = [
        init,
        {"event": ev.RUNTIME_RESUME, "step": 0, "from_checkpoint": False},
        *(_fp(s, f"h{s}") for s in range(6)),
        init,  # killed at 6, resumed at 3: 3..5 again, then on to 8
        {"event": ev.RUNTIME_RESUME, "step": 3, "from_checkpoint": True},
        *(_fp(s, f"h{s}") for s in range(3, 9)),
        init,  # killed at 9, resumed at 6: straddles both attempts
        {"event": ev.RUNTIME_RESUME, "step": 6, "from_checkpoint": True},
        _fp(6, "h6"),
        _fp(7, "other"),
    ]
    n, div = across_attempts(log)
    assert n == 4 and div is not None and div.step == 7 and div.differed == "inputs"
    assert compare({1: ("a", None)}, {1: ("a", 2.0)}) == (1, None)


def _write(path: Path, events: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, e in enumerate(events):
            f.write(json.dumps({"ts": f"2027-01-15T08:00:{i:02d}Z", **e}) + "\n")


def test_report_and_chaos_invariant_show_verified_and_diverged(tmp_path: Path) -> None:
    base = {"rank": 0, "restart": 0}
    good = [
        {**base, "event": ev.RUNTIME_INIT, "pid": 1},
        {**base, "event": ev.RUNTIME_RESUME, "step": 0, "from_checkpoint": False},
        *({**base, **_fp(s, f"h{s}")} for s in range(4)),
        {**base, "event": ev.RUNTIME_INIT, "pid": 2, "restart": 1},
        {**base, "event": ev.RUNTIME_RESUME, "step": 2, "from_checkpoint": True, "restart": 1},
        *({**base, **_fp(s, f"h{s}"), "restart": 1} for s in range(2, 4)),
        {**base, "event": ev.RESUME_VERIFIED, "steps": 2, "of": 2, "restart": 1},
    ]
    _write(tmp_path / "ok" / "logs" / "rank0.jsonl", good)
    status, failures = check_replay(tmp_path / "ok")
    assert failures == [] and status.startswith("pass (2 replayed")
    assert "replay check         1 resume(s) verified on 1 rank(s), 2 replayed" in format_report(
        analyze(tmp_path / "ok")
    )
    bad = [*good[:-2], {**base, **_fp(3, "zz"), "restart": 1}]
    bad.append({**base, "event": ev.RESUME_DIVERGED, "step": 3, "differed": "inputs"})
    _write(tmp_path / "bad" / "logs" / "rank0.jsonl", bad)
    status, failures = check_replay(tmp_path / "bad")
    assert status.startswith("fail") and len(failures) == 2 and "step 3" in failures[0]
    assert "DIVERGED: rank 0 at step 3: the inputs differ" in format_report(
        analyze(tmp_path / "bad")
    )


# ---------------------------------------------------------------------- real runs


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_loop_that_carries_a_batch_is_reported_on_its_first_resume(tmp_path: Path) -> None:
    """nanoGPT's order: the next batch is drawn at the end of each micro-step. Saved every 3
    steps; rank 1 SIGKILLs itself in step 5; the restart resumes at 3 and draws step 3's batch
    afresh from the restored RNG: the first replayed step differs, on every rank."""
    run_dir = tmp_path / "run"
    cmd = torchrun_cmd(
        "chaos.inject",
        ["--fault=kill@rank=1,step=5", "--", str(GPT), "--steps=6", "--prefetch"],
        max_restarts=1,
        extra=["-m"],
    )
    env = {"RESILIENT_RUN_DIR": str(run_dir), "RESILIENT_CHECKPOINT_DIR": str(tmp_path / "ck")}
    with Run(cmd, log_path=tmp_path / "out.log", env=env) as run:
        assert run.wait(150) == 0, run.output()[-4000:]
        out = run.output()
    diverged = ev.read_events(run_dir, ev.RESUME_DIVERGED)
    assert sorted((e["rank"], e["step"], e["differed"]) for e in diverged) == [
        (0, 3, "inputs"),
        (1, 3, "inputs"),
    ]
    assert "resume.diverged" in out and "prefetched" in out  # the console warning
    assert ev.read_events(run_dir, ev.RESUME_VERIFIED) == []


def _check_resume(args: list[str], log: Path, own: tuple[str, ...] = ()) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "resilient.cli", "check-resume", *own, "--nproc-per-node=2"]
    cmd += args
    with Run(cmd, log_path=log) as run:
        rc = run.wait(240)
        return rc, run.output()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_resume_fails_on_a_prefetching_loop_and_names_the_cause(tmp_path: Path) -> None:
    rc, out = _check_resume([str(GPT), "--steps=6", "--prefetch"], tmp_path / "out.log")
    assert rc == 1, out[-3000:]
    assert "FAIL: the resumed run diverged at step 3" in out and "prefetched" in out
    assert not list(Path.cwd().glob("checkpoints"))  # nothing outside its scratch directory


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_resume_says_an_unseeded_script_is_not_deterministic_from_its_start(
    tmp_path: Path,
) -> None:
    """The model built without a seed: the two runs differ at step 0, before any stop. The
    report says so and names the fixes, and never blames the resume (nor runs it)."""
    rc, out = _check_resume([str(GPT), "--steps=6", "--unseeded"], tmp_path / "out.log")
    assert rc == 1, out[-3000:]
    assert "FAIL: not a resume failure: the two runs differ at step 0" in out, out[-3000:]
    assert "before the stop at step 3" in out and "not deterministic from its start" in out
    assert "torch.manual_seed" in out and "use_deterministic_algorithms" in out
    assert "resumed run diverged" not in out and "3/3 resumed" not in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_resume_names_gradients_carried_across_steps(tmp_path: Path) -> None:
    """A loop that never calls zero_grad(): grads.carried at the first save, and check-resume
    names it first among the likely causes of the divergence after the resume."""
    keep = tmp_path / "keep"
    rc, out = _check_resume(
        [str(GPT), "--steps=6", "--no-zero-grad"], tmp_path / "out.log", ("--keep", str(keep))
    )
    assert rc == 1, out[-3000:]
    assert "FAIL: the resumed run diverged at step" in out, out[-3000:]
    assert "not a resume failure" not in out
    assert "likely first:" in out and "grads.carried" in out and "zero_grad()" in out
    carried = ev.read_events(keep / "straight" / "run", ev.GRADS_CARRIED)
    assert sorted(e["rank"] for e in carried) == [0, 1]  # once per rank, at the first save
    assert {e["step"] for e in carried} == {3} and all(e["held"] == 4 for e in carried)


def test_grads_zeroed_at_the_start_of_a_step_are_not_carried() -> None:
    """The one-shot look at the next backward tells a loop that zeroes late (at the start of
    the step: nothing carried) from one that never zeroes."""
    from resilient.replay.grads import CarriedGrads

    for zero_at_start, warned in ((True, False), (False, True)):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        log = _Log()
        carried = CarriedGrads(log)
        for step in range(3):
            if zero_at_start:
                opt.zero_grad()
            model(torch.ones(2, 3)).sum().backward()
            opt.step()
            carried.at_save(model, step + 1)  # every boundary: it looks at the first only
        assert [e["event"] for e in log.events] == (["grads.carried"] if warned else [])
        if warned:
            assert log.events[0]["step"] == 1 and log.events[0]["held"] == 2
    # a save before any backward finds no .grad and looks again at the next one
    model = torch.nn.Linear(3, 1)
    log = _Log()
    carried = CarriedGrads(log)
    carried.at_save(model, 0)
    for step in range(2):
        model(torch.ones(2, 3)).sum().backward()
        carried.at_save(model, step + 1)
    assert [(e["event"], e["step"]) for e in log.events] == [("grads.carried", 1)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_resume_passes_on_the_ddp_recipe(tmp_path: Path) -> None:
    recipe = REPO / "recipes" / "train_ddp.py"
    args = ["--steps=8", "--corpus-chars=20000", "--save-every=4", "--log-every=100"]
    mine = tmp_path / "mine"  # the recipe's own locations must stay untouched
    rc, out = _check_resume(
        [str(recipe), *args, f"--ckpt-dir={mine}", f"--run-dir={mine}"], tmp_path / "out.log"
    )
    assert rc == 0, out[-3000:]
    assert "PASS: resumed at step 4 of 8: 8 step fingerprint(s) on 2 rank(s)" in out
    assert not mine.exists()


def test_check_resume_splits_its_flags_torchrun_flags_and_the_script(tmp_path: Path) -> None:
    from resilient.replay.check_resume import _parse, _torchrun, main

    script = tmp_path / "train.py"
    script.write_text("")
    args = _parse(["--steps", "8", "--nproc-per-node", "2", str(script), "--lr", "3"])
    assert (args.steps, args.torchrun, args.script) == (
        8,
        ["--nproc-per-node", "2"],
        [str(script), "--lr", "3"],
    )
    assert "--standalone" in _torchrun(args)
    assert "--standalone" not in _torchrun(_parse(["--rdzv-endpoint=h:1", str(script)]))
    assert main(["--steps", "1", str(script)]) == 2  # fewer than 2 steps cannot be halved
    assert main(["--nproc-per-node", "2"]) == 2  # no script
    assert main([str(tmp_path / "missing.py")]) == 2
