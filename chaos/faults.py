"""In-process fault injection at a chosen (rank, step, phase), from outside resilient.

A fault spec is `KIND@key=value,...`:

    oom@rank=1,step=5,phase=forward          raise torch.OutOfMemoryError
    raise@rank=2,step=3,phase=backward       raise RuntimeError
    hang@rank=1,step=4,phase=forward         sleep forever in the main thread
    stop@rank=1,step=4                       SIGSTOP itself (it cannot dump its own stacks)
    kill@rank=0,step=6,phase=optimizer       SIGKILL itself
    kill@rank=1,step=9,phase=snapshot        SIGKILL itself inside the in-memory snapshot
                                             taken after step 9, before it is complete
    kill@rank=1,step=9,phase=replicate       SIGKILL itself while the snapshot of step 9
                                             goes to its buddy (sharded state under hot
                                             recovery), between the header and the tensors
    stop@rank=2,phase=reform,generation=1    SIGSTOP itself on its way into generation 1
                                             of a hot recovery (before its groups form)
    oom_exit@rank=1,step=5,phase=forward     exit at once with the OOM exit code (a lost
                                             process, not an exception)
    slow@rank=2,phase=forward,seconds=0.2    sleep that long every step (a straggler)

Keys: rank (default: every rank), step (default: every step), phase (default: step; any
resilient phase name), times (how often it fires; default 1, `slow` unlimited), skip (let
this many matches pass first, e.g. skip=1 with phase=backward hits the second entry of a
step, after the guard's agreement), restart (the TORCHELASTIC_RESTART_COUNT it fires in;
default 0 so a restarted group runs clean; `any` for every attempt), generation (the
RESILIENT_GENERATION it fires in, default 0: a hot recovery's replacement and re-run
survivors run clean; `any` for every one), seconds (for slow and
hang). A fault's first firing prints one `chaos.fault {json}` line to stderr (kind, rank,
step, phase, wall time) and appends a `chaos.fault` event to <run_dir>/logs/chaos.jsonl, as
the chaos runner does for the faults it sends from outside, so `resilient report` sees both.

`install()` wraps `resilient.runtime.heartbeat.Progress.enter`, the one method every phase
change goes through, so a fault fires right when a rank enters the phase: production code
holds no test hook. The exception propagates from there exactly as if the model had raised.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

__all__ = ["KINDS", "Fault", "install", "parse", "uninstall"]

KINDS = {
    "oom": "raise torch.OutOfMemoryError",
    "raise": "raise RuntimeError",
    "hang": "sleep in the main thread (forever, or `seconds`)",
    "stop": "SIGSTOP this process",
    "kill": "SIGKILL this process",
    "oom_exit": "os._exit(ExitCode.OOM): the process is gone, as after the OOM killer",
    "slow": "sleep `seconds` (default 0.1) each time",
}


@dataclass(kw_only=True, slots=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int | None = None
    phase: str = "step"
    times: int | None = 1
    """How many times it fires; None: every time it matches."""
    restart: int | None = 0
    """The restart attempt it fires in; None: every attempt."""
    generation: int | None = 0
    """The hot-recovery generation it fires in; None: every generation."""
    seconds: float | None = None
    skip: int = 0
    """Matches to let pass before firing."""
    fired: int = field(default=0, compare=False)
    seen: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; known: {sorted(KINDS)}")
        from resilient.runtime.heartbeat import Phase

        if self.phase not in (SNAPSHOT, REPLICATE, REFORM):  # not phases: see install
            Phase.parse(self.phase)  # raises on an unknown phase name

    def matches(self, rank: int, restart: int, step: int, phase: str, generation: int = 0) -> bool:
        hit = (
            (self.rank is None or self.rank == rank)
            and (self.restart is None or self.restart == restart)
            and (self.generation is None or self.generation == generation)
            and (self.step is None or self.step == step)
            and self.phase == phase
            and (self.times is None or self.fired < self.times)
        )
        if hit:
            self.seen += 1
        return hit and self.seen > self.skip

    def fire(self, rank: int, step: int, phase: str) -> None:
        self.fired += 1
        where = f"rank {rank}, step {step}, phase {phase}"
        if self.fired == 1:  # a `slow` fault fires every step: its start is the event
            _record(self.kind, rank, step, phase)
        elif self.kind in ("raise", "oom"):  # fired again (times=2): a fault of its own
            _record(self.kind, rank, step, phase, repeat=self.fired - 1)
        if self.kind == "oom":
            import torch

            raise torch.OutOfMemoryError(f"CUDA out of memory (chaos: injected at {where})")
        if self.kind == "raise":
            raise RuntimeError(f"chaos: injected failure at {where}")
        if self.kind == "slow":
            time.sleep(0.1 if self.seconds is None else self.seconds)
        elif self.kind == "hang":
            deadline = time.monotonic() + (self.seconds if self.seconds is not None else 1e9)
            while time.monotonic() < deadline:  # time.sleep releases the GIL: heartbeats go on
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        elif self.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "oom_exit":
            from resilient.exitcodes import ExitCode

            os._exit(int(ExitCode.OOM))


def _record(kind: str, rank: int, step: int, phase: str, repeat: int | None = None) -> None:
    """One `chaos.fault {json}` line on stderr, and the same event in <run_dir>/logs/
    chaos.jsonl (where `resilient report` reads fault times) once the run logs there.
    `repeat`: the n-th firing again of one armed fault (the runner counts first firings)."""
    now = time.time()
    record: dict[str, Any] = {"kind": kind, "rank": rank, "step": step, "phase": phase, "time": now}
    if repeat is not None:
        record["repeat"] = repeat
    print(f"chaos.fault {json.dumps(record)}", file=sys.stderr)
    sys.stderr.flush()
    from resilient import log

    rank_log = log.log_path()  # the rank's JSON log, when configured
    if rank_log is None:
        return
    ts = datetime.fromtimestamp(now, timezone.utc).isoformat().replace("+00:00", "Z")
    event = {"event": "chaos.fault", "ts": ts, "target_rank": rank, "in_process": True}
    line = json.dumps({**event, **record}) + "\n"
    path = os.path.join(os.path.dirname(rank_log), "chaos.jsonl")
    with contextlib.suppress(OSError):  # O_APPEND: ranks may write at the same moment
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def parse(spec: str) -> Fault:
    """`KIND@key=value,...` -> Fault (see the module docstring). ValueError on a bad spec."""
    kind, _, rest = spec.strip().partition("@")
    fields: dict[str, Any] = {"kind": kind.strip().lower()}
    if fields["kind"] == "slow":
        fields["times"] = None
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"fault spec {spec!r}: {item!r} is not key=value")
        key, value = key.strip(), value.strip()
        if key in ("rank", "step", "times", "restart", "skip", "generation"):
            fields[key] = None if value in ("any", "*") else int(value)
        elif key == "seconds":
            fields[key] = float(value)
        elif key == "phase":
            fields[key] = value.lower()
        else:
            raise ValueError(f"fault spec {spec!r}: unknown key {key!r}")
    return Fault(**fields)


SNAPSHOT = "snapshot"
"""A pseudo-phase: the fault fires inside the in-memory snapshot of step `step`, after the
copy into its buffer and before the buffer is marked complete."""
REPLICATE = "replicate"
"""A pseudo-phase: the fault fires in the background exchange of the snapshot of step `step`
with the buddy (runtime/replica.py), after the headers crossed and before any tensor did."""
REFORM = "reform"
"""A pseudo-phase: the fault fires as the rank enters the roll call of a new hot-recovery
generation (hot.roll_call, before its process groups form): a survivor re-running its script,
or the replacement. Give it `generation=N` (N >= 1) and no step."""
_installed: list[Fault] = []
_original: Any = None
_generation = [0]
_original_take: Any = None
_original_swap: Any = None
_original_roll_call: Any = None


def install(faults: list[Fault]) -> None:
    """Arm `faults` in this process (before the training script creates its Runtime)."""
    global _original
    from resilient.runtime.heartbeat import Progress

    _installed[:] = faults
    _generation[0] = int(os.environ.get("RESILIENT_GENERATION", "0"))  # a re-run: the next one
    if _original is not None:
        return
    _original = Progress.enter
    rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    original = _original

    def enter(self: Any, phase: Any) -> None:
        original(self, phase)
        name = phase.name.lower()
        for f in _installed:
            if f.matches(rank, restart, self.step, name, _generation[0]):
                f.fire(rank, self.step, name)

    Progress.enter = enter  # type: ignore[method-assign]
    _wrap_snapshots(rank, restart)
    _wrap_roll_call(rank, restart)


def _wrap_snapshots(rank: int, restart: int) -> None:
    """Faults with phase=snapshot fire inside `Snapshots.take`, once its copy is made and
    before the step is marked held: a kill there loses the copy in the making."""
    global _original_take
    from resilient.runtime import snapshot

    take, copy = snapshot.Snapshots.take, snapshot._copy
    _original_take = (take, copy)
    due: list[tuple[Fault, int]] = []

    def take_(self: Any, step: int) -> None:
        gen = _generation[0]
        due[:] = [(f, step) for f in _installed if f.matches(rank, restart, step, SNAPSHOT, gen)]
        try:
            take(self, step)
        finally:
            due.clear()

    def copy_(*args: Any, **kwargs: Any) -> Any:
        out = copy(*args, **kwargs)
        for f, step in list(due):
            f.fire(rank, step, SNAPSHOT)
        return out

    snapshot.Snapshots.take = take_  # type: ignore[method-assign]
    snapshot._copy = copy_
    _wrap_replicas(rank, restart)


def _wrap_replicas(rank: int, restart: int) -> None:
    """Faults with phase=replicate fire inside `BuddyReplicas._swap` (the replica thread),
    when the structure of the tensors to come is known on both sides: the buddy is then
    waiting for tensors that never come."""
    global _original_swap
    from resilient.runtime import replica

    swap, fill = replica.BuddyReplicas._swap, replica._fill
    _original_swap = (swap, fill)
    due: list[tuple[Fault, int]] = []

    def swap_(self: Any, step: int, *args: Any) -> Any:
        gen = _generation[0]
        due[:] = [(f, step) for f in _installed if f.matches(rank, restart, step, REPLICATE, gen)]
        try:
            return swap(self, step, *args)
        finally:
            due.clear()

    def fill_(*args: Any, **kwargs: Any) -> Any:
        for f, step in list(due):
            f.fire(rank, step, REPLICATE)
        return fill(*args, **kwargs)

    replica.BuddyReplicas._swap = swap_  # type: ignore[method-assign,assignment]
    replica._fill = fill_


def _wrap_roll_call(rank: int, restart: int) -> None:
    """Faults with phase=reform fire as the rank enters hot.roll_call (the Runtime looks it
    up at the call, so replacing the module's function reaches it)."""
    global _original_roll_call
    from resilient.runtime import hot

    roll_call = _original_roll_call = hot.roll_call

    def roll_call_(store: Any, rank_: int, world: int, wd: Any) -> None:
        for f in _installed:
            if f.matches(rank, restart, -1, REFORM, _generation[0]):
                f.fire(rank, -1, REFORM)
        roll_call(store, rank_, world, wd)

    hot.roll_call = roll_call_


def uninstall() -> None:
    global _original, _original_take, _original_swap, _original_roll_call
    from resilient.runtime import hot, replica, snapshot
    from resilient.runtime.heartbeat import Progress

    if _original is not None:
        Progress.enter = _original  # type: ignore[method-assign]
        _original = None
    if _original_take is not None:
        snapshot.Snapshots.take, snapshot._copy = _original_take  # type: ignore[method-assign]
        _original_take = None
    if _original_swap is not None:
        replica.BuddyReplicas._swap, replica._fill = _original_swap  # type: ignore[method-assign]
        _original_swap = None
    if _original_roll_call is not None:
        hot.roll_call = _original_roll_call
        _original_roll_call = None
    _installed.clear()
