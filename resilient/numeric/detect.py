"""Seeing a numerical fault, on every rank at once, before it changes a weight.

`NumericWatch` hooks the tracked optimizer's `step()`. Before the optimizer reads a gradient,
each rank screens its own gradients in one call (its shards under FSDP2; under DDP they are
already all-reduced, so a NaN on one rank is a NaN on all): a NaN or inf anywhere raises the
screen's flag, and only then does an exact look (and a norm for the event) follow. It checks
the loss the script observed and, with spike detection on, compares that loss with its
running mean.

Agreeing costs no message of its own in the usual DDP step. The reduced gradients are the
same on every rank, so their screen gives every rank the same verdict on them. A loss
observed before its backward carries its own verdict into them: a hook on the node that made
the loss makes the gradient flowing back from it NaN when the loss is non-finite or spiked,
so DDP's gradient all-reduce puts the NaN on every rank (the way the OOM guard's failing rank
joins it, guard/attempt.py), and every rank finds it before `optimizer.step()`. Only then, on a
finding, does one all-gather on the control group name the rank it came from and what each
saw. Where the gradients are not replicated (FSDP2's shards, or a loop without a tracked
optimizer), or with spike detection on and a loss observed after its backward (too late to
ride the all-reduce), one all-reduce of a single number a step agrees whether any rank saw
anything, and the all-gather follows only when one did (docs/numerics.md#detection).

A step with a finding (or one listed to be skipped) has its gradients dropped (set to None):
the optimizer then changes nothing, and the loop's end of step (runtime/loops.py) rolls
back, skips or stops (numeric/respond.py).

A loop without a tracked optimizer is checked at the end of the step instead (the loss
only); its update has then happened, which a rollback undoes.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from resilient.groups.groups import DistContext
from resilient.numeric.config import NumericConfig
from resilient.numeric.screen import any_nonfinite, norm, screen

__all__ = ["Fault", "NumericWatch"]

_LOSS_BAD, _GRAD_BAD, _SPIKE, _LOSS, _NORM, _MEAN, _HAS, _CARRIED = range(8)
_WIDTH = 8


@dataclass(slots=True)
class Fault:
    """What the ranks agreed they saw at `step`."""

    step: int
    ranks: list[int]
    """The ranks that saw it (under DDP a non-finite gradient is on every rank: the loss,
    when observed, names the one it came from)."""
    seen: dict[int, list[str]] = field(default_factory=dict)
    """rank -> what: "loss non-finite", "gradient non-finite", "loss spike"."""
    loss: dict[int, float | str | None] = field(default_factory=dict)
    """rank -> the observed loss ("nan", "inf" when not finite; None: not observed)."""
    grad_norm: dict[int, float | str | None] = field(default_factory=dict)
    threshold: dict[int, float | None] = field(default_factory=dict)
    """The spike threshold in force on each rank (spike_factor x running mean)."""
    phase: str = "optimizer"
    """Where it was seen: "optimizer" (before step()) or "end of step"."""

    @property
    def origin(self) -> list[int]:
        """The ranks it came from: those whose own loss was bad, else all that saw it (an
        all-reduced gradient is bad everywhere: without an observed loss, no rank is named)."""
        own = [r for r in self.ranks if set(self.seen.get(r, ())) - {"gradient non-finite"}]
        return own or self.ranks

    def event(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "ranks": self.ranks,
            "origin": self.origin,
            "seen": {str(r): w for r, w in self.seen.items()},
            "loss": {str(r): v for r, v in self.loss.items()},
            "grad_norm": {str(r): v for r, v in self.grad_norm.items()},
            "threshold": {str(r): v for r, v in self.threshold.items() if v is not None},
            "phase": self.phase,
        }


class LossMean:
    """The running mean of this rank's loss (a Stateful: checkpointed and snapshotted per
    rank, so a resumed or rolled-back run judges spikes exactly as before)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.mean: float | None = None
        self.count = 0

    def update(self, loss: float) -> None:
        a = 2.0 / (self.window + 1)
        self.mean = loss if self.mean is None else (1 - a) * self.mean + a * loss
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean, self.count = state["mean"], int(state["count"])


class Skipped:
    """The steps skipped so far (a Stateful in the common blob: every rank alike, kept on
    every world size)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = [int(s) for s in state["steps"]]


class NumericWatch:
    """Per-step numerical checks, agreed across ranks (see the module doc)."""

    def __init__(self, config: NumericConfig, ctx: DistContext) -> None:
        self.config = config
        self.ctx = ctx
        self.loss_mean = LossMean(config.spike_window)
        self.skipped = Skipped()
        self._optimizer: torch.optim.Optimizer | None = None
        self._step: int | None = None
        self._loss: torch.Tensor | float | None = None
        """The step's observed loss so far: a number when it lives on the host (read once, as
        it is observed), a tensor on its device (read with the screen: one sync a step)."""
        self._checked = False
        self._fault: Fault | None = None
        self._skip_step = False
        self._replicated = False
        self._tokens = 0
        self._unfired: set[int] = set()
        """This step's loss hooks that have not run yet (observed after their backward, or
        not part of it): their verdict did not ride the gradient all-reduce."""
        self._unhooked = False
        """A loss was observed that no hook can follow (a number, or a tensor with no
        gradient): its verdict cannot ride the gradients either."""
        self._params: list[torch.Tensor] = []
        self._grad_norm: torch.Tensor | float | None = None
        """The step's gradient norm as the loop computed it (observe(grad_norm=...)): the
        screen then reads it instead of passing over the gradients itself."""
        self._flags: dict[torch.device, torch.Tensor] = {}
        """The screen's flag per device, kept at zero between steps (cleared when raised)."""
        self._param_lists: list[tuple[list[torch.Tensor], int]] = []
        """Each group's list of parameters and its length when `_params` was walked."""
        self._spiked: torch.Tensor | bool = False
        """This rank turned its gradients NaN for a loss spike (not for a NaN loss, whose
        gradients are non-finite by themselves): the other ranks' non-finite gradients
        are then this rank's doing, not theirs."""

    @property
    def enabled(self) -> bool:
        c = self.config
        return c.nonfinite or c.spike_factor is not None or bool(c.skip_steps)

    def attach(self, optimizer: torch.optim.Optimizer | None, *, replicated: bool = False) -> Any:
        """Hook `optimizer.step()`; the hook's handle (None without an optimizer).

        `replicated`: every rank holds the same reduced gradients when step() runs (DDP), so
        a non-finite gradient is seen by all ranks alike, and a loss observed before its
        backward carries its verdict into them (the module doc): the ranks agree without a
        message of their own, and the all-gather runs only after a finding, to name its
        origin."""
        self._optimizer = optimizer
        self._replicated = replicated and optimizer is not None
        if optimizer is None or not self.enabled:
            return None
        return optimizer.register_step_pre_hook(self._before_optimizer_step)

    def begin(self, step: int) -> None:
        self._step, self._loss, self._checked, self._fault = step, None, False, None
        self._skip_step = step in self.config.skip_steps or step in self.skipped.steps
        self._unfired, self._unhooked, self._spiked = set(), False, False
        self._grad_norm = None

    def observe_grad_norm(self, value: Any) -> None:
        """The total norm of the gradients `optimizer.step()` will read, as the loop computed
        it after the step's last backward (`clip_grad_norm_`'s result): finite exactly when
        every element is, so the screen's own pass is not needed. A DTensor is not used (its
        local value may be a partial norm): the screen runs as before."""
        if not self.enabled or self._step is None:
            return
        if type(value) is not torch.Tensor and hasattr(value, "to_local"):
            return
        self._grad_norm = _scalar(value, "grad_norm", "takes the total norm, a scalar; got")

    def observe_loss(self, loss: Any) -> None:
        if not self.enabled or self._step is None:
            return
        value = _scalar(loss, "loss", "takes a scalar loss, got", ": reduce it first (loss.mean())")
        if self._loss is None:
            self._loss = value
        elif isinstance(self._loss, torch.Tensor) and isinstance(value, torch.Tensor):
            self._loss = self._loss + value.to(self._loss.device)
        else:  # a number and a number, or a device tensor and a number
            self._loss = self._loss + value
        if not self._replicated:
            return
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            self._tokens += 1
            self._unfired.add(self._tokens)
            hook = self._carry(self._tokens)
            node = loss.grad_fn
            if node is None:  # a leaf
                loss.register_hook(hook)
            else:  # the same hook on the node that makes the loss: a third of the cost
                node.register_prehook(_on_output(hook, loss.output_nr))
        else:
            self._unhooked = True

    def _threshold(self) -> float | None:
        """The loss above which this step spikes (None: not judged yet, or off)."""
        mean, factor = self.loss_mean.mean, self.config.spike_factor
        if factor is None or mean is None or self.loss_mean.count < self.config.spike_window:
            return None
        return factor * mean

    def _carry(self, token: int) -> Any:
        """The hook on an observed loss: while its backward runs (before DDP reduces a
        gradient), the gradient leaving it turns NaN when the step's loss so far is
        non-finite or spiked, so DDP's all-reduce carries the verdict to every rank."""

        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            self._unfired.discard(token)
            loss, thr, nonfinite = self._loss, self._threshold(), self.config.nonfinite
            if loss is None or (thr is None and not nonfinite):
                return None
            if not isinstance(loss, torch.Tensor):  # a number on the host: decide here
                v = loss
                spike = thr is not None and math.isfinite(v) and v > thr
                if spike:
                    self._spiked = True
                return grad * math.nan if spike or (nonfinite and not math.isfinite(v)) else None
            # on a device: decide there, without waiting for it
            finite = torch.isfinite(loss)
            spike_t = finite & (loss > thr) if thr is not None else torch.zeros_like(finite)
            self._spiked = spike_t | self._spiked
            bad = spike_t | ~finite if nonfinite else spike_t
            return grad * torch.where(bad, math.nan, 1.0).to(grad.dtype)

        return hook

    def end_step(self) -> Fault | None:
        """The step's agreed fault (None: none). Checks now when no optimizer step did."""
        if self.enabled and not self._checked and self._step is not None:
            self._check(grads=None, phase="end of step")
        fault, self._fault = self._fault, None
        if fault is None and self._loss is not None and self.config.spike_factor is not None:
            self.loss_mean.update(float(self._loss))
        self._step = None  # checked: a second call in the same step finds nothing
        return fault

    @property
    def skipping(self) -> bool:
        """The current step's update is being skipped (listed, or skipped by the policy)."""
        return self._skip_step

    # ---------------------------------------------------------------- the check
    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._step is None:  # outside the loop (a warm-up step of the script's own)
            return
        grads = [g for g in map(_grad, self._params_of(optimizer)) if g is not None]
        self._check(grads=grads, phase="optimizer")
        if self._fault is not None or self._skip_step:
            optimizer.zero_grad(set_to_none=True)  # step() then changes nothing

    def _params_of(self, optimizer: Any) -> list[torch.Tensor]:
        """The optimizer's parameters, walked again only when its groups change (a group
        added, or a group's list replaced or resized): the walk is a per-step cost."""
        lists = list(map(_params, optimizer.param_groups))
        if len(lists) != len(self._param_lists) or any(
            ps is not held or len(ps) != n
            for ps, (held, n) in zip(lists, self._param_lists, strict=True)
        ):
            self._params = [p for ps in lists for p in ps]
            self._param_lists = [(ps, len(ps)) for ps in lists]
        return self._params

    def _check(self, grads: list[torch.Tensor] | None, phase: str) -> None:
        self._checked = True
        loss, spiked = self._loss, self._spiked
        flag = self._screen(grads)
        if (
            not isinstance(loss, torch.Tensor)
            and not (isinstance(flag, torch.Tensor) and not flag.is_cpu)
            and not isinstance(spiked, torch.Tensor)
        ):  # all on the host (the usual CPU step): no tensors to build and move
            loss_t = math.nan if loss is None else loss
            screened = 0.0 if flag is None else float(flag)
            carried = spiked
        else:  # the loss, the screen and the carried spike come to the host together: one
            # device sync a step
            parts = [
                loss
                if isinstance(loss, torch.Tensor)
                else torch.tensor(math.nan if loss is None else loss)
            ]
            parts.append(flag if isinstance(flag, torch.Tensor) else torch.tensor(flag or 0.0))
            parts.append(spiked if isinstance(spiked, torch.Tensor) else torch.tensor(spiked))
            loss_t, screened, carried_f = _host(parts)
            carried = bool(carried_f)
        flagged, norm_t = bool(grads) and screened != 0.0, math.nan  # NaN != 0 too
        if flagged:  # the screen flags: the exact look, and the norm for the event
            self._flags.clear()  # the next step's screen starts from a fresh zero
            flagged = any_nonfinite(grads or [])
            norm_t = float(norm(grads or [])) if flagged else math.nan
        has_loss, has_norm = loss is not None, flagged
        nonfinite, thr = self.config.nonfinite, self._threshold()
        loss_bad = nonfinite and has_loss and not math.isfinite(loss_t)
        grad_bad = nonfinite and has_norm and not math.isfinite(norm_t)
        spike = carried or (thr is not None and has_loss and loss_t > thr)
        if not self._agree(loss_bad or grad_bad or spike, flagged, grads):
            return
        mine = torch.zeros(_WIDTH, dtype=torch.float64)
        mine[_HAS] = has_loss + 2 * has_norm
        mine[_LOSS], mine[_NORM] = loss_t, norm_t
        mine[_LOSS_BAD], mine[_GRAD_BAD], mine[_SPIKE] = loss_bad, grad_bad, spike
        mine[_MEAN] = math.nan if self.loss_mean.mean is None else self.loss_mean.mean
        mine[_CARRIED] = carried
        every = self._gather(mine)
        if bool(every[:, _CARRIED].any()):  # NaN gradients of a spike's own making
            every[:, _GRAD_BAD] = 0
        ranks = [r for r in range(len(every)) if bool(every[r][:3].any())]
        if not ranks:
            return
        factor = self.config.spike_factor
        fault = Fault(step=int(self._step or 0), ranks=ranks, phase=phase)
        for r in ranks:
            row = every[r].tolist()
            fault.seen[r] = [
                what
                for idx, what in (
                    (_LOSS_BAD, "loss non-finite"),
                    (_GRAD_BAD, "gradient non-finite"),
                    (_SPIKE, "loss spike"),
                )
                if row[idx]
            ]
            has = int(row[_HAS])
            fault.loss[r] = _said(row[_LOSS]) if has & 1 else None
            fault.grad_norm[r] = _said(row[_NORM]) if has & 2 else None
            m = row[_MEAN]
            fault.threshold[r] = None if math.isnan(m) or factor is None else factor * m
        self._fault = fault

    def _screen(self, grads: list[torch.Tensor] | None) -> torch.Tensor | float | None:
        """0 when every gradient is finite, non-zero (or NaN) when one is not (None: no
        gradients). From the norm the loop observed when it gave one, else the screen."""
        if not grads:
            return None
        given = self._grad_norm
        if given is None:
            return screen(grads, self._flags)
        if isinstance(given, torch.Tensor):  # on its device: read with the loss, one sync
            return (~torch.isfinite(given)).float()
        return 0.0 if math.isfinite(given) else 1.0

    def _agree(self, mine: bool, flagged: bool, grads: list[torch.Tensor] | None) -> bool:
        """Whether any rank saw something this step (the same answer on every rank)."""
        if not self.ctx.distributed or self.ctx.world_size == 1:
            return mine
        if self._replicated and grads:
            carried = not self._unfired and not self._unhooked
            if carried or self.config.spike_factor is None:
                # the reduced gradients, the same on every rank, hold every verdict (each
                # observed loss's rode the all-reduce), or the only one that matters across
                # ranks: a NaN loss whose gradients stayed finite is this rank's alone
                return flagged
        flag = torch.tensor([float(mine)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctx.control_group)
        return bool(flag[0])

    def _gather(self, mine: torch.Tensor) -> torch.Tensor:
        if not self.ctx.distributed or self.ctx.world_size == 1:
            return mine.unsqueeze(0)
        out = [torch.zeros_like(mine) for _ in range(self.ctx.world_size)]
        dist.all_gather(out, mine, group=self.ctx.control_group)
        return torch.stack(out)


def _on_output(hook: Any, nr: int) -> Any:
    """A tensor hook as a pre-hook of the node that made the tensor (its output `nr`)."""

    def pre(grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...] | None:
        grad = grads[nr]
        new = None if grad is None else hook(grad)
        return None if new is None else (*grads[:nr], new, *grads[nr + 1 :])

    return pre


def _scalar(value: Any, name: str, says: str, fix: str = "") -> torch.Tensor | float:
    """What `rt.observe(<name>=value)` hands over: a number on the host (a CPU tensor is read
    at once), or a detached float32 0-d tensor on its device (read later, with the screen).
    ValueError for a tensor of more than one element, TypeError for anything else."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"rt.observe({name}=...) {says} a tensor of shape {tuple(value.shape)}{fix}"
            )
        if value.is_cpu:
            return value.item()
        held = value.detach()
        return held.reshape(()).float() if held.dim() or held.dtype != torch.float32 else held
    if isinstance(value, int | float):
        return float(value)
    raise TypeError(
        f"rt.observe({name}=...) takes a scalar tensor or a number, got {type(value).__name__}"
    )


def _host(parts: list[torch.Tensor]) -> list[float]:
    """Scalars as Python floats: one transfer for those on a device."""
    if all(t.device.type == "cpu" for t in parts):
        return [float(t) for t in parts]
    values: list[float] = torch.stack([t.float().cpu() for t in parts]).double().tolist()
    return values


_grad = operator.attrgetter("grad")
_params = operator.itemgetter("params")


def _said(v: float) -> float | str:
    """A value for an event: the number, or "nan", "inf", "-inf" (JSON has no such floats)."""
    return v if math.isfinite(v) else str(v)
