"""`resilient check-resume [--steps N] [torchrun flags] script.py [args]`: is a resume exact?

Runs the script twice under torchrun, on scratch checkpoint and log directories (the script's
own are never touched: $RESILIENT_CHECK_SCRATCH overrides what it passes to init()):

1. straight: N steps (the script's own length, or --steps N);
2. stopped after N/2 steps with a committed checkpoint ($RESILIENT_STOP_AT), then launched
   again: it resumes there and runs to N.

Before the resume it compares the stopped run's steps before the stop with the straight run's:
if they already differ, the script is not deterministic from its start (an unseeded model,
nondeterministic kernels) and the report says so, with the usual fixes, instead of blaming
the resume. Then it compares, rank by rank, the per-step fingerprints (the first forward
inputs of each step, and the loss when the script calls rt.observe(loss=...)) of the resumed
steps with the straight run's, and the final state's sha256 ($RESILIENT_FINAL_DIGEST). It
prints PASS, or the first step that differs, what differed and the likely causes (first
gradients carried across steps, when a run logged `grads.carried`: resilient/replay/grads.py);
exit code 0 on PASS, 1 on a divergence, 2 when the check could not run (bad usage, a run
failed). While a run goes, its progress (rank 0's newest step, from its event log) and then
the comparison's go to `progress` (the command line's status line on stderr,
resilient/live/status.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from resilient import events as ev
from resilient.envvars import ENV_FINAL_DIGEST, ENV_SCRATCH, ENV_STOP_AT
from resilient.replay.compare import CAUSES, Divergence, compare, fingerprints
from resilient.replay.grads import ADVICE as GRADS_ADVICE

__all__ = ["main"]

NOT_DETERMINISTIC = (
    "the script is not deterministic from its start, so no resume can match it: seed every "
    "RNG before the model is built (torch.manual_seed(seed) on every rank, and the loader's "
    "generator=), and turn on deterministic kernels (torch.use_deterministic_algorithms(True); "
    "on a GPU also CUBLAS_WORKSPACE_CONFIG=:4096:8, docs/porting.md#gpu-determinism)"
)

_USAGE = (
    "usage: resilient check-resume [--steps N] [--keep DIR] [--timeout S] [torchrun flags] "
    "script.py [args]"
)


class Progress(Protocol):
    """Where progress goes: a status line that is redrawn, and cleared before a line of
    output (resilient.live.status.StatusLine)."""

    def show(self, text: str) -> object: ...
    def clear_for_others(self) -> None: ...


class _Usage(Exception):
    pass


class _Help(Exception):
    pass


@dataclass(slots=True)
class _Args:
    steps: int | None
    keep: Path | None
    timeout_s: float
    torchrun: list[str]
    script: list[str]


def _parse(argv: list[str]) -> _Args:
    steps: int | None = None
    keep: Path | None = None
    timeout = 600.0
    rest = list(argv)
    while rest and rest[0] in ("--steps", "--keep", "--timeout", "-h", "--help"):
        flag = rest.pop(0)
        if flag in ("-h", "--help"):
            raise _Help
        if not rest:
            raise _Usage(f"{flag} needs a value\n{_USAGE}")
        value = rest.pop(0)
        try:
            if flag == "--steps":
                steps = int(value)
                if steps < 2:
                    raise ValueError
            elif flag == "--timeout":
                timeout = float(value)
            else:
                keep = Path(value)
        except ValueError:
            raise _Usage(
                f"{flag} {value!r}: --steps takes a number >= 2, --timeout seconds"
            ) from None
    at = next((i for i, a in enumerate(rest) if a.endswith(".py") or Path(a).is_file()), None)
    if {"-h", "--help"} & set(rest[:at]):  # among torchrun's flags, before the script
        raise _Help
    if at is None:
        raise _Usage(f"no script given\n{_USAGE}")
    if not Path(rest[at]).is_file():
        raise _Usage(f"{rest[at]}: no such script")
    return _Args(steps, keep, timeout, rest[:at], rest[at:])


def _torchrun(args: _Args) -> list[str]:
    flags = list(args.torchrun)
    own_rdzv = any(f.startswith(("--standalone", "--rdzv", "--master")) for f in flags)
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *([] if own_rdzv else ["--standalone"]),
        *flags,
        *args.script,
    ]


def _launch(
    cmd: list[str],
    scratch: Path,
    stop_at: int | None,
    log: Path,
    timeout: float,
    tick: Callable[[], None] | None = None,
) -> int:
    env = dict(os.environ)
    env[ENV_SCRATCH] = str(scratch)
    env[ENV_FINAL_DIGEST] = "1"
    env.pop(ENV_STOP_AT, None)
    if stop_at is not None:
        env[ENV_STOP_AT] = str(stop_at)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            return _wait(proc, timeout, tick)
        except subprocess.TimeoutExpired:
            # torchrun passes SIGTERM on to its workers (they run in sessions of their own)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return -1


def _wait(proc: subprocess.Popen[bytes], timeout: float, tick: Callable[[], None] | None) -> int:
    """proc.wait(timeout), calling `tick` about twice a second meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        try:
            return proc.wait(timeout=min(0.5, left))
        except subprocess.TimeoutExpired:
            if tick is not None:
                tick()


def _ticker(progress: Progress | None, what: str, run: Path, of: int | None) -> Callable[[], None]:
    """Shows `what` with rank 0's newest completed step in `run` (read as its log grows)."""
    tail = ev.EventTail(run / "logs", "rank0.jsonl")
    t0 = time.monotonic()
    step: list[int] = []

    def tick() -> None:
        new = [int(e["last"]) + 1 for e in tail.read_new() if e.get("event") == ev.TRAIN_PROGRESS]
        step[:] = new[-1:] or step
        done = f"step {step[-1]}" + (f" of {of}" if of else "") if step else "starting"
        if progress is not None:
            progress.show(f"{what}: {done} ({time.monotonic() - t0:.0f} s)")

    return tick


def _say(progress: Progress | None, line: str) -> None:
    if progress is not None:
        progress.clear_for_others()
    print(line, flush=True)


def _last_launch(run: Path, rank: int) -> list[dict[str, object]]:
    """A rank's events from its newest process on (the launch after the resume)."""
    logged = ev.read_events(run, rank=rank)
    inits = [i for i, e in enumerate(logged) if e.get("event") == ev.RUNTIME_INIT]
    return logged[inits[-1] :] if inits else []


def _digest(events: list[dict[str, object]]) -> object:
    found = [e.get("digest") for e in events if e.get("event") == ev.RUNTIME_DIGEST]
    return found[-1] if found else None


def check(args: _Args, work: Path, progress: Progress | None = None) -> int:
    cmd = _torchrun(args)
    straight, resumed = work / "straight", work / "resumed"
    log = work / "output.log"
    print(f"check-resume: {' '.join(cmd)}\n  scratch: {work}", flush=True)
    _say(progress, "  1/3 straight run ...")
    tick = _ticker(progress, "1/3 straight run", straight / "run", args.steps)
    if (rc := _launch(cmd, straight, args.steps, log, args.timeout_s, tick)) != 0:
        return _failed_run("the straight run", rc, log)
    done = ev.latest_event(straight / "run", ev.RUNTIME_DONE, rank=0)
    n = args.steps or (int(done["step"]) if done and isinstance(done.get("step"), int) else 0)
    if n < 2:
        print(
            "check-resume: cannot check: the script ran fewer than 2 steps through "
            "rt.steps()/rt.epochs() (or none)",
            file=sys.stderr,
        )
        return 2
    half = n // 2
    _say(progress, f"  2/3 stopped at step {half} of {n} ...")
    tick = _ticker(progress, "2/3 run to the stop", resumed / "run", half)
    if (rc := _launch(cmd, resumed, half, log, args.timeout_s, tick)) != 0:
        return _failed_run("the run stopped halfway", rc, log)
    ranks = sorted({int(e["rank"]) for e in ev.read_events(straight / "run", ev.RUNTIME_INIT)})
    early = _first_divergence(straight / "run", resumed / "run", ranks, progress, last=False)
    if early[1] is not None:
        if progress is not None:
            progress.clear_for_others()
        return _not_deterministic(early[1], half)
    _say(progress, f"  3/3 resumed from step {half} ...")
    tick = _ticker(progress, "3/3 resumed run", resumed / "run", n)
    if (rc := _launch(cmd, resumed, n, log, args.timeout_s, tick)) != 0:
        return _failed_run("the resumed run", rc, log)
    again = ev.latest_event(resumed / "run", ev.RUNTIME_RESUME, rank=0)
    if not again or not again.get("from_checkpoint") or again.get("step") != half:
        print(
            f"FAIL: the second launch did not resume from the checkpoint of step {half} "
            f"(it logged {again}): does the script pass its checkpoint location to init()?",
        )
        return 1
    compared, first = _first_divergence(straight / "run", resumed / "run", ranks, progress)
    if progress is not None:
        progress.clear_for_others()  # the verdict's lines follow
    d_straight = _digest(_last_launch(straight / "run", 0))
    d_resumed = _digest(_last_launch(resumed / "run", 0))
    carried = _carried(straight / "run", resumed / "run")
    if first is not None:
        print(
            f"FAIL: the resumed run diverged at step {first.step} on rank {first.rank}: the "
            f"{first.differed} differ from the straight run's ({first.before} straight, "
            f"{first.now} resumed; resumed at step {half} of {n}):\n  {carried}{first.causes}"
        )
        return 1
    if d_straight is None or d_resumed is None:
        print("FAIL: no final state digest was logged (does the script track a model?)")
        return 1
    if d_straight != d_resumed:
        print(
            f"FAIL: every step's inputs{' and loss' if compared else ''} matched "
            f"({compared} step(s) on {len(ranks)} rank(s)), but the final state differs "
            f"({str(d_straight)[:12]} straight, {str(d_resumed)[:12]} resumed): "
            f"{carried}{CAUSES['loss']}"
        )
        return 1
    print(
        f"PASS: resumed at step {half} of {n}: {compared} step fingerprint(s) on "
        f"{len(ranks)} rank(s) and the final state (sha256 {str(d_straight)[:12]}...) are "
        "identical to the straight run"
    )
    return 0


def _first_divergence(
    straight: Path, stopped: Path, ranks: list[int], progress: Progress | None, *, last: bool = True
) -> tuple[int, Divergence | None]:
    """(steps compared, the earliest divergence over the ranks) between the straight run and
    the stopped run's newest launch (`last`: the resumed steps) or its whole log (the steps
    before the stop: both runs started from nothing, so any difference is the script's)."""
    compared, first = 0, None
    for i, r in enumerate(ranks):
        if progress is not None:
            progress.show(f"comparing rank {i + 1} of {len(ranks)}: {compared} step(s) compared")
        before = fingerprints(ev.read_events(straight, rank=r))
        after = fingerprints(_last_launch(stopped, r) if last else ev.read_events(stopped, rank=r))
        k, div = compare(before, after, rank=r)
        compared += k
        if div is not None and (first is None or div.step < first.step):
            first = div
    return compared, first


def _not_deterministic(div: Divergence, half: int) -> int:
    print(
        f"FAIL: not a resume failure: the two runs differ at step {div.step} on rank "
        f"{div.rank}, before the stop at step {half}, with nothing resumed yet: the "
        f"{div.differed} differ ({div.before} in the first run, {div.now} in the second). "
        f"The resume was not checked:\n  {NOT_DETERMINISTIC}"
    )
    return 1


def _carried(*runs: Path) -> str:
    """The likely cause to name first when a run logged grads.carried, else ""."""
    for run in runs:
        found = ev.read_events(run, ev.GRADS_CARRIED)
        if found:
            e = found[0]
            return (
                f"likely first: {e.get('held')} parameter(s) held a non-zero .grad at the step "
                f"boundary of step {e.get('step')} (e.g. {e.get('param')}) that the next step "
                f"added to (grads.carried, rank {e.get('rank')}): {GRADS_ADVICE}.\n  Else: "
            )
    return ""


def _failed_run(what: str, rc: int, log: Path) -> int:
    tail = log.read_text(errors="replace")[-3000:]
    why = "timed out" if rc == -1 else f"exited with {rc}"
    print(f"check-resume: {what} {why}; its output ends with:\n{tail}", file=sys.stderr)
    return 2


def main(argv: list[str], *, progress: Progress | None = None) -> int:
    try:
        args = _parse(argv)
    except _Help:
        print(f"{_USAGE}\n\n{__doc__}")
        return 0
    except _Usage as e:
        print(str(e), file=sys.stderr)
        return 2
    if args.keep is not None:
        if args.keep.exists() and any(args.keep.iterdir()):
            print(f"check-resume: --keep {args.keep} is not empty; give a new directory")
            return 2
        args.keep.mkdir(parents=True, exist_ok=True)
        return check(args, args.keep, progress)
    work = Path(tempfile.mkdtemp(prefix="resilient-check-resume-"))
    try:
        return check(args, work, progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)
