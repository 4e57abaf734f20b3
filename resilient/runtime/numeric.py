"""The runtime's answer to an agreed numerical fault (the rule is numeric/respond.py).

Every rank runs `act` with the same fault, so every rank takes the same branch: a rollback
in place (left pending for the step loop), a skip (the step's update was already dropped:
the loop goes on), a cold restart from the newest checkpoint, or a stop with
ExitCode.NUMERICAL_FAULT. Before leaving, a save in flight (of a step before the fault) is
waited for, so the newest good checkpoint is committed; the checkpoint location records the
fault, so retention keeps the newest checkpoint from before it and a restart that meets it
again knows it is persistent.
"""

from __future__ import annotations

from typing import Any

from resilient.exitcodes import ExitCode
from resilient.groups.exits import exit_now
from resilient.numeric.detect import Fault
from resilient.numeric.replicas import disagreeing, local_fingerprint, odd_ranks, replicas_agree
from resilient.numeric.respond import RESTART, ROLLBACK, SKIP, FaultLedger, decide

__all__ = ["NumericResponse"]


class NumericResponse:
    """Acts on the faults a Runtime's NumericWatch agreed (see the module doc)."""

    def __init__(self, rt: Any) -> None:
        """`rt`: the Runtime (typed loosely: runtime.py imports this module)."""
        self._rt = rt
        self.ledger = FaultLedger()
        self._ddp: bool | None = None
        self._rerun: tuple[int, int] | None = None
        """A sampled step run once: (step, this rank's fingerprint after it)."""
        self._replaying: Fault | None = None
        """A fault rolled back: when its step closes cleanly, it was transient."""
        self._clean_at = 0
        """The step of the last clean replica check, or of the resume: the replicas agreed
        there, so a mismatch found later began in a step from this one on."""
        self._unproven: list[int] = []
        """Steps saved since the last clean replica check: their staging copy ran after that
        check, beside training, so a bit flipped meanwhile may be in them (DDP, sdc)."""

    def adopt_recorded(self) -> None:
        """At a resume: the faults earlier attempts recorded in the checkpoint location."""
        try:
            self.ledger.adopt(self._rt.checkpoints.numerical_faults())
        except Exception as e:  # unreadable: counted from here on (the error names the file)
            self._rt.log.warning("numeric.record_unreadable", error=str(e)[:300])

    def act(self, fault: Fault, *, can_roll_back: bool) -> None:
        rt, config = self._rt, self._rt.config.numeric
        times = self.ledger.count(fault.step)
        snapshots = can_roll_back and rt.snapshots.enabled
        action = decide(
            times_seen=times,
            policy=config.policy,
            skips_used=len(rt.numeric.skipped.steps),
            max_skips=config.max_skips,
            can_roll_back=snapshots,
        )
        batch = rt._batches.last_batch() if rt._batches is not None else None
        rt.log.error("numeric.fault", **fault.event(), times_seen=times, action=action, batch=batch)
        self._record(fault)
        if self._replaying is not None and self._replaying.step == fault.step:
            self._replaying = None  # it came back: not transient
        if action == ROLLBACK:
            if rt.snapshots.agree_rollback(fault.step, fault.origin[0]):
                self._replaying = fault
                return  # the step loop rolls back (snapshots.pending)
            action = RESTART
        if action == SKIP:
            rt.numeric.skipped.steps.append(fault.step)
            rt.log.warning("numeric.skip", step=fault.step, skipped=rt.numeric.skipped.steps)
            return
        if action == RESTART:
            why = (
                "a replica mismatch: snapshots may hold it, the newest checkpoint was checked"
                if fault.phase == "replica check"
                else "a re-run differs: which run was right is unknown"
                if fault.phase == "re-run"
                else "snapshots are off (snapshot={'enabled': True} rolls back in place)"
                if not rt.snapshots.enabled
                else "this loop cannot roll back in place (epochs(), or no snapshot held "
                "by every rank)"
            )
            rt.log.warning("numeric.restart", step=fault.step, reason=why)
            self._leave(ExitCode.RANK_EXCEPTION, fault, "restart from the newest checkpoint")
        self._leave(ExitCode.NUMERICAL_FAULT, fault, "persistent: stopped")

    def replicas_due(self, step: int) -> bool:
        config = self._rt.config.numeric
        return config.sdc and step % config.sdc_every == 0

    def check_replicas(self, step: int) -> None:
        """DDP or HSDP with `sdc` on: every replica's parameters (HSDP: local shards, within
        each replicate group) must be bit-identical (a collective on every rank). A mismatch
        is a fault that no snapshot can undo (they may hold the corruption): the run
        restarts from the newest checkpoint, checked at its save."""
        rt = self._rt
        model = rt.state.model
        if not rt.config.numeric.sdc or model is None or not self._replicated():
            return
        groups = self._replica_groups()
        values = replicas_agree(model, rt.ctx, groups)
        if values is None:
            # a save before this step finished its staging copy before this step's forward:
            # what it copied is what the replicas agree on now
            self._unproven = [s for s in self._unproven if s >= step]
            self._clean_at = step
            return
        odd = odd_ranks(values, groups)
        ranks = odd if odd else disagreeing(values, groups)
        what = "parameters differ from the other replicas" if odd else "replicas disagree"
        fault = Fault(
            step=step, ranks=ranks, seen={r: [what] for r in ranks}, phase="replica check"
        )
        rt.log.error(
            "numeric.sdc",
            step=step,
            fingerprints=values,
            odd_ranks=odd,
            suspect=self._unproven,
            clean_since=self._clean_at,  # the replay check trusts no step in [this, step)
        )
        self.act(fault, can_roll_back=False)

    def resumed(self, step: int) -> None:
        """The state at `step` came from a checkpoint, a snapshot or a fresh start: every
        replica holds the same bits there."""
        self._clean_at, self._unproven = step, []

    def saving(self, step: int) -> None:
        """A save of `step` starts, after its replica check passed (Runtime.save)."""
        if self._rt.config.numeric.sdc and self._ddp:
            self._unproven.append(step)

    def rerun_due(self, step: int) -> bool:
        """Step `step` is sampled for a re-run (its snapshot must be taken before it)."""
        config = self._rt.config.numeric
        return config.rerun and step > 0 and step % config.rerun_every == 0

    def rerun(self, step: int) -> None:
        """After the body of a sampled step (every rank alike): the first time, note this
        rank's fingerprint and leave a rollback to the snapshot before the step pending, so
        the loop runs it again; the second time, compare. A difference on any rank is a
        numerical fault (silent data corruption: which run was right is unknown, so the run
        restarts from the newest checkpoint, and a repeat at the same step is persistent)."""
        rt = self._rt
        if not self.rerun_due(step) or not rt.snapshots.enabled or rt.state.model is None:
            return
        mine = local_fingerprint(rt.state.model, rt.state.optimizer)
        if self._rerun is None or self._rerun[0] != step:
            if step not in rt.snapshots.held:  # not every rank holds it: no re-run here
                rt.log.warning("numeric.rerun.skipped", step=step, held=rt.snapshots.held)
                return
            self._rerun = (step, mine)
            rt.snapshots.pending = step  # the same on every rank: all hold the forced one
            return
        first, self._rerun = self._rerun[1], None
        differs = self._gather_flag(first != mine)
        if not any(differs):
            rt.log.debug("numeric.rerun.equal", step=step)
            return
        ranks = [r for r, d in enumerate(differs) if d]
        rt.log.error("numeric.rerun.differs", step=step, ranks=ranks)
        what = {r: ["a re-run of the step gave other bits"] for r in ranks}
        self.act(Fault(step=step, ranks=ranks, seen=what, phase="re-run"), can_roll_back=False)

    def _gather_flag(self, flag: bool) -> list[bool]:
        import torch
        import torch.distributed as dist

        ctx = self._rt.ctx
        if not ctx.distributed or ctx.world_size == 1:
            return [flag]
        mine = torch.tensor([int(flag)], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
        dist.all_gather(every, mine, group=ctx.control_group)
        return [bool(int(t)) for t in every]

    def _replicated(self) -> bool:
        """Some ranks hold identical parameters (the mesh's replicate peers: DDP's whole
        world, HSDP's replicate groups), so the replica check has something to compare."""
        if self._ddp is None:
            rt = self._rt
            self._ddp = rt.state.model is not None and len(rt.layout.replicas(rt.rank)) > 1
        return self._ddp

    def _replica_groups(self) -> list[list[int]]:
        """The replicate groups, each once (MeshLayout: no rank arithmetic here)."""
        layout = self._rt.layout
        return [list(g) for g in dict.fromkeys(tuple(layout.replicas(r)) for r in layout.grid)]

    def closed(self, step: int) -> None:
        """Step `step` closed without a fault: a fault rolled back at it was transient."""
        fault = self._replaying
        if fault is not None and step == fault.step:
            self._replaying = None
            strikes = self.ledger.strike(fault.origin)
            self._rt.log.warning(
                "numeric.transient",
                step=step,
                ranks=fault.origin,
                strikes=strikes,
                suspect=[r for r, n in strikes.items() if n > 1],
            )

    def _record(self, fault: Fault) -> None:
        try:
            # a replica mismatch: the checkpoints saved since the last clean check may hold
            # it; a restart must not load them, and a replay replaces them (checkpoint/faults)
            suspect = {"suspect": list(self._unproven)} if fault.phase == "replica check" else {}
            self._rt.checkpoints.note_numerical_fault(
                fault.step, ranks=fault.ranks, seen=fault.event()["seen"], **suspect
            )
        except Exception as e:  # the record helps retention; the fault is handled anyway
            self._rt.log.warning("numeric.record_failed", step=fault.step, error=str(e)[:300])

    def _leave(self, code: ExitCode, fault: Fault, what: str) -> Any:
        rt = self._rt
        try:
            rt.checkpoints.wait()  # a save of a step before the fault: let it commit
        except Exception as e:
            rt.log.warning("numeric.save_in_flight_failed", error=str(e)[:300])
        exit_now(code, kind="numeric", step=fault.step, ranks=fault.ranks, action=what)
