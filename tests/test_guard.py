"""The OOM/exception guard: in-process units, then 3-rank gloo runs with injected failures.

The multi-rank runs use chaos.inject to raise the real torch.OutOfMemoryError (or a
RuntimeError) at a chosen (rank, step, phase) in tests/workers/guarded_train.py. The
headline check: after a DDP OOM retried in place, the parameters are bit-for-bit those of a
run that used the smaller micro-batch split from that step on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import exit_events, launch_ranks, only_event

from chaos.procs import events, latest_event
from resilient.errors import ConfigError
from resilient.exitcodes import ExitCode
from resilient.groups.groups import DistContext
from resilient.guard.guard import SPLIT_FILE, Guard
from resilient.hang.config import WatchdogConfig
from resilient.hang.watchdog import Watchdog

STEPS = ["--steps", "6"]


# ---------------------------------------------------------------------------- one process
def single_guard(tmp_path: Path) -> Guard:
    ctx = DistContext(
        rank=0, world_size=1, local_rank=0, restart=0, run_id="t", host="h", backend=None
    )
    wd = Watchdog(WatchdogConfig(enabled=False), ctx, str(tmp_path))
    return Guard(wd, ctx, str(tmp_path))


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
    )


def train_step(guard: Guard, model: torch.nn.Module, x, y, *, split=None, oom_times=0) -> int:
    """One guarded step; the body raises OutOfMemoryError in its first `oom_times` attempts."""
    attempts = 0
    for mb in guard.micro_batches(x, y, model=model, split=split):
        with mb:
            if mb.index == 0:
                attempts += 1
                if attempts <= oom_times:
                    torch.randn(3)  # consume RNG first: the retry must not see the difference
                    raise torch.OutOfMemoryError("CUDA out of memory (test)")
            loss = torch.nn.functional.mse_loss(model(mb.inputs[0]), mb.inputs[1])
            mb.backward(loss)
    return attempts


def test_micro_batches_cover_the_batch_with_weights(tmp_path: Path) -> None:
    guard = single_guard(tmp_path)
    x, y = torch.arange(16.0).view(8, 2), torch.arange(8.0)
    seen = []
    for mb in guard.micro_batches(x, y, split=3):
        with mb:
            seen.append((mb.inputs[0][:, 0].tolist(), mb.weight, mb.last, mb.count))
    assert [len(s[0]) for s in seen] == [3, 3, 2]
    assert sum(s[1] for s in seen) == 1.0 and [s[2] for s in seen] == [False, False, True]
    assert [v for s in seen for v in s[0]] == x[:, 0].tolist()
    with pytest.raises(ConfigError, match="same, non-zero size"):
        next(guard.micro_batches(x, y[:5]))
    with pytest.raises(ConfigError, match="split must be >= 1"):
        next(guard.micro_batches(x, split=0))


def test_split_gradients_match_the_whole_batch(tmp_path: Path) -> None:
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    model = tiny_model().eval()  # no dropout: the two computations see the same function
    train_step(single_guard(tmp_path), model, x, y, split=4)
    split_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    for a, p in zip(split_grads, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad)


def test_oom_retry_in_process_is_bitwise_a_smaller_split(tmp_path: Path, events) -> None:
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    torch.manual_seed(5)
    retried = tiny_model()
    torch.manual_seed(5)
    guard = single_guard(tmp_path / "a")
    assert train_step(guard, retried, x, y, oom_times=2) == 3  # split 1 -> 2 -> 4
    rng_after = torch.get_rng_state()
    assert guard.split == 4  # and it stays for the next steps
    reference = tiny_model()
    torch.manual_seed(5)
    train_step(single_guard(tmp_path / "b"), reference, x, y, split=4)
    assert torch.equal(rng_after, torch.get_rng_state())
    for a, b in zip(retried.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    retries = events("oom.retry")
    assert [(e["split_from"], e["split_to"]) for e in retries] == [(1, 2), (2, 4)]
    assert json.loads((tmp_path / "a" / SPLIT_FILE).read_text())["split"] == 4


# ---------------------------------------------------------------------------- three ranks
def digest(out: Path) -> str:
    return str(json.loads((out / "run" / "final_digest.json").read_text())["digest"])


def failures(run: Path) -> list[dict[str, Any]]:
    return [e for e in events(run) if e.get("event") == "guard.failure"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Fault-free runs whose split grows at step 3, as the retried runs' does."""
    out = {}
    for name, splits, *more in (
        ("1to2", "3:2"),
        ("2to4", "0:2,3:4"),
        ("1to2-hook", "3:2", "--comm-hook"),
    ):
        d = tmp_path_factory.mktemp(f"ref-{name}")
        codes, _ = launch_ranks(d, [], *STEPS, "--splits", splits, *more)
        assert codes == [0, 0, 0]
        out[name] = digest(d)
    return out


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("phase", "splits", "ref", "hook"),
    [
        ("forward", "", "1to2", False),
        ("backward", "0:2", "2to4", False),
        ("forward", "", "1to2-hook", True),
    ],
)
def test_ddp_oom_retry_is_bitwise_the_smaller_split(
    tmp_path: Path, reference: dict[str, str], phase: str, splits: str, ref: str, hook: bool
) -> None:
    """An OOM on rank 1 at step 3 (in the forward of a whole batch; or at the end of the
    forward of the first of two micro-batches, while its peers run that micro-batch's
    no_sync backward and then the synced one): every rank retries the batch in twice as
    many micro-batches and the run ends bit-for-bit where a run that used that split from
    step 3 on ends. With a Python comm hook (torch's all-reduce hook, whose rounding differs
    from DDP's own reduction: its reference uses it too) the vote rides beside the backward
    instead of being folded into it."""
    args = [*STEPS, "--splits", splits] if splits else STEPS
    if hook:
        args = [*args, "--comm-hook"]
    codes, _ = launch_ranks(tmp_path, [f"oom@rank=1,step=3,phase={phase}"], *args)
    run = tmp_path / "run"
    assert codes == [0, 0, 0], codes
    (fail,) = failures(run)
    assert (fail["rank"], fail["kind"], fail["step"], fail["phase"]) == (1, "oom", 3, phase)
    retry = latest_event(run, "oom.retry", rank=0)
    assert retry is not None and retry["failed_rank"] == 1 and retry["step"] == 3
    # from the second batch on, rank 1 joined its peers' gradient all-reduce with NaN, and
    # the agreement was folded into it: no vote unless the reduced gradients are not finite
    # (guard/attempt.py); with a Python comm hook the vote rides beside the backward
    assert retry["agreed"] == (
        "beside the backward" if hook else "folded into the gradient all-reduce"
    )
    first = 2 if splits else 1
    assert (retry["split_from"], retry["split_to"]) == (first, 2 * first)
    assert json.loads((run / SPLIT_FILE).read_text())["split"] == 2 * first
    assert digest(tmp_path) == reference[ref]


@pytest.mark.timeout(120)
def test_gradients_not_finite_by_themselves_are_not_a_failure(tmp_path: Path) -> None:
    """Rank 0's loss is NaN at step 3: every rank's reduced gradients are NaN, as after a
    failed rank's join, so every rank votes; nobody failed, so the step goes on, once."""
    codes, _ = launch_ranks(tmp_path, [], *STEPS, "--nan-at", "3")
    run = tmp_path / "run"
    assert codes == [0, 0, 0], codes
    seen = [e for e in events(run) if e.get("event") == "guard.nonfinite_gradients"]
    assert sorted((e["rank"], e["step"]) for e in seen) == [(0, 3), (1, 3), (2, 3)]
    unwanted = ("oom.retry", "guard.failure", "guard.agreed", "fault.detected")
    assert not [e for e in events(run) if e.get("event") in unwanted]
    assert (run / "final_digest.json").is_file()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_oom_at_the_floor_exits_together_and_the_split_carries(tmp_path: Path) -> None:
    floor = {"min_micro_batch_size": 2}
    codes, _ = launch_ranks(
        tmp_path, ["oom@rank=1,step=2,phase=forward,times=3"], *STEPS, watchdog=floor
    )
    run = tmp_path / "run"
    assert codes == [ExitCode.OOM] * 3, codes
    agreed = only_event(run, "guard.agreed")
    assert agreed["floor_reached"] and agreed["split"] == 4 and agreed["failed_rank"] == 1
    retries = [e for e in events(run, rank=0) if e.get("event") == "oom.retry"]
    assert [(e["split_from"], e["split_to"]) for e in retries] == [(1, 2), (2, 4)]
    assert exit_events(run) == {r: ExitCode.OOM for r in range(3)}
    assert json.loads((run / SPLIT_FILE).read_text())["split"] == 4
    # the next attempt starts at the split the last one reached
    codes, _ = launch_ranks(tmp_path, [], *STEPS, watchdog=floor)
    assert codes == [0, 0, 0], codes
    carried = latest_event(run, "guard.split", rank=0)
    assert carried is not None and carried["split"] == 4


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_fsdp_oom_exits_fast_and_restarts_with_the_carried_split(tmp_path: Path) -> None:
    codes, _ = launch_ranks(tmp_path, ["oom@rank=1,step=3,phase=forward"], *STEPS, "--fsdp")
    run = tmp_path / "run"
    assert codes == [ExitCode.OOM] * 3, codes
    fault = only_event(run, "fault.detected")
    assert fault["kind"] == "failure" and fault["ranks"] == [1] and fault["rank"] == 1
    assert "OutOfMemoryError" in fault["reason"]
    assert json.loads((run / SPLIT_FILE).read_text())["split"] == 2
    codes, _ = launch_ranks(tmp_path, [], *STEPS, "--fsdp")
    assert codes == [0, 0, 0], codes
    carried = latest_event(run, "guard.split", rank=0)
    assert carried is not None and carried["split"] == 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_plain_guard_exception_takes_the_group_down(tmp_path: Path) -> None:
    codes, _ = launch_ranks(
        tmp_path, ["raise@rank=2,step=3,phase=forward"], *STEPS, "--mode", "guard"
    )
    run = tmp_path / "run"
    assert codes == [ExitCode.RANK_EXCEPTION] * 3, codes
    fault = only_event(run, "fault.detected")
    assert fault["kind"] == "failure" and fault["ranks"] == [2]
    (fail,) = failures(run)
    assert fail["rank"] == 2 and "chaos: injected failure" in fail["exception"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_exception_in_a_micro_batch_is_agreed_on(tmp_path: Path) -> None:
    codes, _ = launch_ranks(tmp_path, ["raise@rank=1,step=3,phase=forward"], *STEPS)
    run = tmp_path / "run"
    assert codes == [ExitCode.RANK_EXCEPTION] * 3, codes
    agreed = only_event(run, "guard.agreed")
    assert agreed["rank"] == 0 and agreed["failed_rank"] == 1 and agreed["cause"] == "exception"
    assert not [e for e in events(run) if e.get("event") in ("hang.detected", "fault.detected")]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_oom_after_the_agreement_releases_peers_blocked_in_the_allreduce(tmp_path: Path) -> None:
    """skip=1: the second entry into `backward` at step 3 is the one after the agreement,
    when healthy ranks already wait in DDP's gradient all-reduce."""
    codes, _ = launch_ranks(tmp_path, ["oom@rank=1,step=3,phase=backward,skip=1"], *STEPS)
    run = tmp_path / "run"
    assert codes == [ExitCode.OOM] * 3, codes
    fault = only_event(run, "fault.detected")
    assert fault["kind"] == "failure" and fault["ranks"] == [1]
    assert json.loads((run / SPLIT_FILE).read_text())["split"] == 2


def test_an_error_torch_rewraps_is_judged_by_its_cause() -> None:
    """A pipeline stage re-raises its backward's error as "Failed to run stage backward"
    with the original as the cause: a peer's loss in DDP's all-reduce there is the peer's,
    and an OOM there is an OOM, not this rank's own exception."""
    from resilient.guard.failure import classify

    def wrapped(cause: BaseException) -> RuntimeError:
        try:
            raise RuntimeError("Failed to run stage backward:\n Stage output: ...") from cause
        except RuntimeError as e:
            return e

    peer = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:1")
    assert classify(wrapped(peer)) == "peer"
    assert classify(wrapped(torch.OutOfMemoryError("CUDA out of memory"))) == "oom"
    assert classify(wrapped(ValueError("shape mismatch"))) == "exception"
    assert classify(ValueError("shape mismatch")) == "exception"
