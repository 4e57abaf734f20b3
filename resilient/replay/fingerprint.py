"""Per-step fingerprints and the online replay check after a resume.

Each completed step gets one `step.fingerprint` event: a 64-bit hash of the tensors the
tracked model's first forward of the step received (a forward pre-hook, armed at the step's
start), and the loss if the script calls `rt.observe(loss=...)`. The hash is a position-
weighted sum of the tensors' raw bits in int64 (wrapping), computed where the tensor lives:
one multiply and one sum (one dot on the host), no copy of the batch to the host. On CUDA the
8-byte result goes to pinned memory without blocking and is read when its event has completed
(the step after at the latest), so the loop never waits for the device. Integer sums do not
depend on the reduction order, so the same inputs give the same hash on every run.

After a resume from step S, `ReplayCheck` compares the fingerprints of the steps this attempt
runs again with those the earlier attempts of this rank logged (resilient.replay.compare): the first
difference is one `resume.diverged` warning naming the step, what differed and the likely
causes; when the replayed steps are done and all matched, one `resume.verified` with the count.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from resilient import events as ev
from resilient.replay.compare import Fingerprint, compare, fingerprints

__all__ = ["ReplayCheck", "StepFingerprints"]

_MASK = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class StepFingerprints:
    """Hashes each step's first forward inputs; logs one event per completed step."""

    def __init__(self, log: Any, *, world: int) -> None:
        self._log = log
        self._world = world
        self.mesh = ""
        """The mesh layout's signature (set at track()): steps replayed on another layout
        are not compared, as those on another world size are not."""
        self._armed = False
        self._step = -1
        self._hash: Any = None  # int, or a 0-dim int64 tensor not yet read
        self._meta = 0
        self._loss: Any = None
        self._pending: list[tuple[int, Any, int, Any, Any]] = []  # step, hash, meta, loss, event
        self._weights: dict[tuple[int, torch.device, bool], torch.Tensor] = {}
        self.check: ReplayCheck | None = None
        self._hooked = False
        """The tracked model's forward is hooked for the inputs; its silence is said once."""
        self._grad_only = False

    @property
    def shape(self) -> tuple[int, str]:
        """(world size, mesh layout): replayed steps compare only on the same shape."""
        return self._world, self.mesh

    def attach(self, model: nn.Module, *, pipeline_stage: bool = False) -> Any:
        """The forward pre-hook on the tracked model; returns its handle. `pipeline_stage`:
        the model is a pipeline's first stage, whose forwards without grad are not the step's
        (torch < 2.13's shape inference runs it once per process on zeros, under no_grad)."""
        self._hooked = True
        self._grad_only = pipeline_stage
        return model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)

    def begin(self, step: int) -> None:
        self._armed, self._step = True, step
        self._hash, self._meta, self._loss = None, 0, None

    def _pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._armed and (torch.is_grad_enabled() or not self._grad_only):
            self.inputs(*args, *kwargs.values())

    def inputs(self, *values: Any) -> None:
        """Fingerprint these values as the step's inputs (the first call of a step counts)."""
        if not self._armed:
            return
        self._armed = False
        tensors: list[torch.Tensor] = []
        meta: list[str] = []
        _collect(values, tensors, meta)
        total: Any = 0
        if all(t.device.type == "cpu" for t in tensors):
            # on the host nothing is waited for: Python ints, not two tensor ops per input
            # (the same value modulo 2**64, all flush() keeps)
            for i, t in enumerate(tensors):
                total += int(self._tensor_hash(t, host=True)) * (2 * i + 1)
        else:
            for i, t in enumerate(tensors):
                total = total + self._tensor_hash(t) * (2 * i + 1)
        self._hash = total
        self._meta = zlib.crc32("|".join(meta).encode())

    def observe_loss(self, loss: Any) -> None:
        """Add `loss` (a tensor or number) to this step's loss record (summed when called for
        several micro-batches)."""
        value = loss.detach().to(torch.float64) if isinstance(loss, torch.Tensor) else float(loss)
        self._loss = value if self._loss is None else self._loss + value

    def end(self, step: int) -> None:
        """Step `step` completed: queue its fingerprint and log the ready ones."""
        if step != self._step:  # begin() was not called for it: nothing to record
            return
        if self._hooked and self._armed:  # a whole step, and the tracked forward never ran
            self._hooked = False
            self._log.warning(
                ev.REPLAY_UNHOOKED,
                step=step,
                reason="the tracked model's forward did not run in this step, so this "
                "rank's inputs are not fingerprinted (a resume cannot check them) and a hang "
                "report cannot name its forward or backward. The loop calls other modules "
                "(an interleaved pipeline's stage modules, a wrapped model's inner module) "
                "or skipped the forward. Said once. Track the module the loop calls; an "
                "interleaved pipeline cannot, and docs/porting.md#pipelines says what it "
                "loses",
            )
        self._armed = False
        done = None
        if any(isinstance(v, torch.Tensor) and v.is_cuda for v in (self._hash, self._loss)):
            self._hash, self._loss = _to_host(self._hash), _to_host(self._loss)
            done = torch.cuda.Event()
            done.record()
        self._pending.append((step, self._hash, self._meta, self._loss, done))
        self.flush(wait=False)

    def flush(self, *, wait: bool = True) -> None:
        """Log the queued fingerprints whose values are on the host (all of them if `wait`)."""
        while self._pending:
            step, h, meta, loss, done = self._pending[0]
            if done is not None:
                if not wait and not done.query():
                    return
                done.synchronize()
            self._pending.pop(0)
            # an odd multiplier mixes the bits (a bijection: nothing is lost)
            inputs = None if h is None else f"{(_int(h) + meta) * _MIX & _MASK:016x}"
            lval = None if loss is None else float(loss)
            if inputs is None and lval is None:
                continue  # no tracked model ran and no loss was handed over: nothing to say
            self._log.debug(  # the JSON log keeps it; the console shows it at DEBUG
                ev.STEP_FINGERPRINT,
                step=step,
                inputs=inputs,
                loss=lval,
                world=self._world,
                **({"mesh": self.mesh} if self.mesh else {}),
            )
            if self.check is not None:  # a later pipeline stage: its loss alone (runtime/stages.py)
                self.check.record(step, (str(inputs), lval))

    def _tensor_hash(self, t: torch.Tensor, *, host: bool = False) -> torch.Tensor:
        flat = t.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        if flat.dtype == torch.bool:
            flat = flat.view(torch.uint8)
        elif flat.is_floating_point():
            flat = flat.view(_INT_OF_SIZE[flat.element_size()])
        # narrow values multiply in int32 (wrapping), no widening copy; the sum is int64
        wide = flat.element_size() > 4
        w = self._weight(flat.numel(), flat.device, wide)
        if host and flat.dtype == torch.int64:  # one kernel, the same sum (CUDA: no int dot)
            return flat.dot(w)
        return (flat * w).sum(dtype=torch.int64)

    def _weight(self, n: int, device: torch.device, wide: bool) -> torch.Tensor:
        key = (n, device, wide)
        w = self._weights.get(key)
        if w is None:
            if len(self._weights) > 8:  # last batches of epochs, eval sizes: keep a few
                self._weights.clear()
            # odd multipliers that differ per position: a reordered batch hashes differently
            w = torch.arange(n, dtype=torch.int64, device=device) * 0x9E3779B1 * 2 + 1
            w = w if wide else w.to(torch.int32)  # wraps to 32 bits, still odd
            self._weights[key] = w
        return w


def _collect(values: Iterable[Any], tensors: list[torch.Tensor], meta: list[str]) -> None:
    for v in values:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            meta.append(f"{v.dtype}{tuple(v.shape)}")
        elif isinstance(v, list | tuple):
            _collect(v, tensors, meta)
        elif isinstance(v, dict):
            _collect((v[k] for k in sorted(v, key=str)), tensors, meta)
        elif v is None or isinstance(v, bool | int | float | str):
            meta.append(repr(v))


def _to_host(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.is_cuda:
        out = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
        out.copy_(v, non_blocking=True)
        return out
    return v


def _int(v: Any) -> int:
    return int(v.item()) if isinstance(v, torch.Tensor) else int(v)


def _corrupted_steps(events: list[dict[str, Any]]) -> set[int]:
    """Steps an attempt ran between its last clean replica check and a mismatch: one replica
    may have been corrupted there, so their losses differ from a clean replay's."""
    out: set[int] = set()
    for e in events:
        if e.get("event") == "numeric.sdc" and isinstance(e.get("clean_since"), int):
            out.update(range(int(e["clean_since"]), int(e["step"])))
    return out


class ReplayCheck:
    """Compares the fingerprints of replayed steps with the earlier attempts' (online)."""

    def __init__(self, log: Any, earlier: dict[int, Fingerprint], *, rank: int) -> None:
        self._log = log
        self._earlier = earlier
        self._rank = rank
        self.matched = 0
        self.last = max(earlier, default=-1)
        self.done = False

    @classmethod
    def open(
        cls,
        log: Any,
        log_path: Path | None,
        *,
        rank: int,
        shape: tuple[int, str],
        resumed_at: int,
    ) -> ReplayCheck | None:
        """After a resume from `resumed_at`: the check against what earlier attempts of this
        rank logged (this process's own events excluded), or None when there is nothing to
        compare (said in a `resume.unverified` event)."""
        if log_path is None:
            return None
        logged = ev.read_events(log_path)
        # this process's own events begin at the last runtime.init (it logged one already)
        inits = [i for i, e in enumerate(logged) if e.get("event") == ev.RUNTIME_INIT]
        past: list[dict[str, Any]] = []
        for e in logged[: inits[-1] if inits else len(logged)]:
            if e.get("event") == ev.RUNTIME_RESUME and not e.get("from_checkpoint"):
                past.clear()  # a fresh start: what came before is another run
            past.append(e)
        corrupted = _corrupted_steps(past)
        earlier = {
            s: f
            for s, f in fingerprints(past, shape=shape).items()
            if s >= resumed_at and s not in corrupted
        }
        untrusted = sorted(s for s in corrupted if s >= resumed_at)
        if untrusted:
            log.info(
                "resume.untrusted",
                steps=[untrusted[0], untrusted[-1]],
                reason="an earlier attempt ran these steps on a corrupted DDP replica "
                "(numeric.sdc): they are replayed without comparison",
            )
        if not earlier:
            other = {s for s in fingerprints(past) if s >= resumed_at}
            log.info(
                ev.RESUME_UNVERIFIED,
                step=resumed_at,
                reason="the earlier attempts ran these steps on another world size or mesh"
                if other
                else "no earlier attempt logged a step after the checkpoint (nothing to replay)",
            )
            return None
        return cls(log, earlier, rank=rank)

    def record(self, step: int, fp: Fingerprint) -> None:
        if self.done:
            return
        if step in self._earlier:
            _, div = compare({step: self._earlier[step]}, {step: fp}, rank=self._rank)
            if div is not None:
                self.done = True
                self._log.warning(
                    ev.RESUME_DIVERGED,
                    step=div.step,
                    differed=div.differed,
                    before=div.before,
                    now=div.now,
                    matched=self.matched,
                    causes=div.causes,
                )
                return
            self.matched += 1
        if step >= self.last:
            self.finish()

    def finish(self) -> None:
        """The replay is over (or the run ends): log the count if nothing diverged."""
        if self.done:
            return
        self.done = True
        self._log.info(
            ev.RESUME_VERIFIED,
            steps=self.matched,
            of=len(self._earlier),
            note=None
            if self.matched == len(self._earlier)
            else "not every earlier step was run again (the run stopped first)",
        )
