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
    spin@rank=1,step=40,phase=forward        busy-loop in Python for ever (or `seconds`):
                                             a stall holding the GIL but for the
                                             interpreter's switch interval
    freeze@rank=1,step=40,phase=forward      sleep in C holding the GIL (for ever, or
                                             `seconds`): a wedged extension; every thread
                                             stops, heartbeats too, the process stays in
                                             state S (a frozen host, as its peers see it)
    nan@rank=1,step=6,phase=forward          the model's output (so its loss) is NaN in
                                             this forward, once: a NaN loss on one rank
    spike@rank=0,step=9,phase=forward,factor=50   the output scaled by `factor`, once
    bad_batch@rank=1,step=7,phase=forward    as nan (or spike, with factor=...) every time
                                             the step runs, in every attempt and generation:
                                             a sample that fails whenever it is seen
    bitflip@rank=2,step=6,phase=optimizer    flip bit `bit` (default 20) of one parameter
                                             element of this rank's model, once: silent
                                             data corruption of one DDP replica
    fork_stall@rank=1,step=0,phase=data      the next process this rank forks (a loader
                                             worker, as the step's first batch starts an
                                             epoch) never runs its Python: a worker stuck
                                             in its fork (CPython gh-112275)

Keys: rank (default: every rank), step (default: every step), phase (default: step; any
resilient phase name), times (how often it fires; default 1, `slow` unlimited), skip (let
this many matches pass first, e.g. skip=1 with phase=backward hits the second entry of a
step, after the guard's agreement), restart (the TORCHELASTIC_RESTART_COUNT it fires in;
default 0 so a restarted group runs clean; `any` for every attempt), generation (the
RESILIENT_GENERATION it fires in, default 0: a hot recovery's replacement and re-run
survivors run clean; `any` for every one), seconds (for slow, spin, freeze and
hang). A fault's first firing prints one `chaos.fault {json}` line to stderr (kind, rank,
step, phase, wall time) and appends a `chaos.fault` event to <run_dir>/logs/chaos.jsonl, as
the chaos runner does for the faults it sends from outside, so `resilient report` sees both.

`install()` arms the runtime's named fault points (resilient/faultpoints.py): a phase entry
(every phase change goes through it, so a fault fires right when a rank enters the phase), an
in-memory snapshot's copy, a replica exchange's headers, a hot generation's roll call. The
exception propagates from there exactly as if the model had raised.
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
    "spin": "busy-loop in Python (forever, or `seconds`): a stall that competes for the GIL",
    "freeze": "sleep in C holding the GIL (forever, or `seconds`): heartbeats stop too",
    "nan": "the tracked model's output becomes NaN in this forward (phase forward)",
    "spike": "the tracked model's output is scaled by `factor` in this forward",
    "bad_batch": "nan (or spike, with factor) whenever the step runs, every attempt",
    "bitflip": "flip bit `bit` (default 20) of one element of the first parameter of the "
    "tracked model on this rank: silent data corruption of one replica",
    "fork_stall": "the next child this rank forks blocks before its first line of Python",
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
    factor: float | None = None
    """spike, bad_batch: the output's scale (bad_batch without it: NaN)."""
    bit: int = 20
    """bitflip: the bit of the element's 32-bit pattern to flip."""
    skip: int = 0
    """Matches to let pass before firing."""
    fired: int = field(default=0, compare=False)
    seen: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; known: {sorted(KINDS)}")
        from resilient.hang.phases import Phase

        if self.phase not in (SNAPSHOT, REPLICATE, REFORM, LEFT):  # not phases: see install
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
        if self.kind == "bitflip":
            _flip_bit(self.bit)
        if self.kind in ("nan", "spike", "bad_batch"):
            _poison_next_output(self.factor if self.kind != "nan" else None, self.kind)
        if self.kind == "slow":
            time.sleep(0.1 if self.seconds is None else self.seconds)
        elif self.kind == "hang":
            deadline = time.monotonic() + (self.seconds if self.seconds is not None else 1e9)
            while time.monotonic() < deadline:  # time.sleep releases the GIL: heartbeats go on
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        elif self.kind == "spin":
            deadline = time.monotonic() + (self.seconds if self.seconds is not None else 1e9)
            while time.monotonic() < deadline:
                sum(range(1000))
        elif self.kind == "freeze":
            import ctypes  # PyDLL keeps the GIL through the call, unlike CDLL

            libc = ctypes.PyDLL(None)
            libc.sleep(ctypes.c_uint(int(self.seconds) if self.seconds is not None else 10**6))
        elif self.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "oom_exit":
            from resilient.exitcodes import ExitCode

            os._exit(int(ExitCode.OOM))
        elif self.kind == "fork_stall":
            _stall_next_fork()


_fork_stall = {"armed": False, "hooked": False}


def _stall_next_fork() -> None:
    """The next child this process forks sleeps for ever in an at-fork hook, before
    multiprocessing starts it (so before a loader's worker_init_fn): from outside, what a
    child deadlocked in the interpreter's own after-fork code looks like."""
    if not _fork_stall["hooked"]:
        os.register_at_fork(
            after_in_child=_stall_if_armed, after_in_parent=lambda: _fork_stall.update(armed=False)
        )
        _fork_stall["hooked"] = True
    _fork_stall["armed"] = True


def _stall_if_armed() -> None:
    while _fork_stall["armed"]:
        time.sleep(3600)


def _flip_bit(bit: int) -> None:
    """Flip `bit` of the middle element of the tracked model's first floating-point
    parameter on this rank, in place: the run goes on, finite, one replica apart."""
    import torch

    import resilient

    model = resilient.current().state.model
    if model is None:
        raise RuntimeError("chaos bitflip: the runtime tracks no model")
    p = next(q for q in model.parameters() if q.is_floating_point() and q.element_size() == 4)
    with torch.no_grad():  # a DTensor's own shard: any DTensor op would be a collective
        local = p.to_local() if hasattr(p, "to_local") else p.data
        flat = local.view(-1).view(torch.int32)
        flat[flat.numel() // 2] ^= 1 << bit


def _poison_next_output(factor: float | None, kind: str) -> None:
    """Scale every floating-point tensor of the tracked model's next output by `factor` (NaN
    when None), keeping autograd: the loss computed from it, and its gradients, follow. The
    hook goes on the model the runtime tracks (resilient.current()), whose phase hook fired
    this fault, so it runs after this very forward and removes itself."""
    import torch

    import resilient

    model = resilient.current().state.model
    if model is None:
        raise RuntimeError(f"chaos {kind}: the runtime tracks no model")
    scale = float("nan") if factor is None else factor

    def poison(out: Any) -> Any:
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            return out * scale
        if isinstance(out, tuple | list):
            return type(out)(poison(o) for o in out)
        if isinstance(out, dict):  # in place: a dict subclass (transformers' ModelOutput,
            for k, v in out.items():  # read as `out.loss`) keeps its type
                out[k] = poison(v)
        return out

    def hook(_module: Any, _args: Any, output: Any) -> Any:
        handle.remove()
        return poison(output)

    handle = model.register_forward_hook(hook)


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
    if fields["kind"] == "bad_batch":  # a property of the data: every time, every attempt
        fields.update(times=None, restart=None, generation=None)
    if fields["kind"] == "spike":
        fields.setdefault("factor", 1000.0)
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"fault spec {spec!r}: {item!r} is not key=value")
        key, value = key.strip(), value.strip()
        if key in ("rank", "step", "times", "restart", "skip", "generation", "bit"):
            fields[key] = None if value in ("any", "*") else int(value)
        elif key in ("seconds", "factor"):
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
with the buddy (memory/replica.py), after the headers crossed and before any tensor did."""
REFORM = "reform"
"""A pseudo-phase: the fault fires as the rank enters the roll call of a new hot-recovery
generation (hot/reform.py's roll call, before its process groups form): a survivor re-running
its script, or the replacement. Give it `generation=N` (N >= 1) and no step."""
LEFT = "left"
"""A pseudo-phase: the fault fires in a survivor that left its generation for generation N
(`generation=N`, N >= 1, no step), in the worker wrapper before it collects the unwound
script's garbage, where a gloo destructor can block (hot/gapwatch.py)."""
_installed: list[Fault] = []
_generation = [0]


def install(faults: list[Fault]) -> None:
    """Arm `faults` in this process (before the training script creates its Runtime), on the
    runtime's named fault points (resilient/faultpoints.py)."""
    from resilient import faultpoints as fp

    _installed[:] = faults
    _generation[0] = int(os.environ.get("RESILIENT_GENERATION", "0"))  # a re-run: the next one
    rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def fire(step: int, phase: str, generation: int | None = None) -> None:
        gen = _generation[0] if generation is None else generation
        for f in _installed:
            if f.matches(rank, restart, step, phase, gen):
                f.fire(rank, step, phase)

    fp.arm(fp.PHASE_ENTER, lambda step, phase: fire(step, phase.name.lower()))
    # a kill there loses the snapshot in the making: copied, not yet marked held
    fp.arm(fp.SNAPSHOT_COPIED, lambda step: fire(step, SNAPSHOT))
    # the buddy then waits for tensors that never come
    fp.arm(fp.REPLICA_HEADERS, lambda step: fire(step, REPLICATE))
    fp.arm(fp.HOT_ROLL_CALL, lambda generation: fire(-1, REFORM))
    # before the script runs again: its generation is still the one being left
    fp.arm(fp.HOT_LEFT, lambda generation: fire(-1, LEFT, generation))


def uninstall() -> None:
    from resilient import faultpoints as fp

    fp.disarm()
    _installed.clear()
