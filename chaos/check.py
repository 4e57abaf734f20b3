"""The invariants, checked after a run from its logs and files (docs/chaos.md explains each):

a. final model and optimizer state bitwise equal to the fault-free run (same seed, world)
b. each restart resumes from the newest checkpoint valid at the fault, and checkpoints
   kept up (at most one interval plus one save in flight behind); steps lost reported;
   a preemption loses no step; a retried storage fault restarts nothing
c. no checkpoint that failed verification was ever loaded
d. the run ended within its time bound
e. no process of the run remains
g. (hot mode, and every numerical fault) each fault was followed by the recovery its
   scenario expects: hot (rolled back in place, or a warm replacement), an OOM retry in
   place, or cold, and for a bad batch then a skip or a stop; a hot one lost at most one
   snapshot interval plus the copy in flight
h. (numerical faults) each was seen at its step and answered as its scenario expects (the
   `numeric.fault` actions, a transient one's `numeric.transient`), and no step faulted that
   no injection poisoned; a stop exited 87; no committed checkpoint holds a NaN or an
   infinity (each one's tensors loaded and checked); the newest checkpoint from before the
   first fault survived retention. A bitflip (silent data corruption of one DDP replica):
   seen by the replica check at the first check step after the flip (chaos/sdc.py), the odd
   rank named by a majority (3+ ranks) or none (2: the replay decides), every save since the
   last clean check named suspect and never loaded, a restart from a checkpoint from before
   the flip, and no save of a step after the flip in its attempt (chaos/check_sdc.py)
i. (mesh scenarios) every step trained, on the attempt that ran it last, on exactly the
   samples of the sampler's order, tp peers on the same ones, across resizes (chaos/mesh.py)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chaos.check_numeric import _check_numeric
from chaos.external import Injected
from chaos.mesh import check_samples, worlds
from chaos.observe import _attempt_inits as _inits
from chaos.observe import _attempt_steps, _epoch
from chaos.plan import Planned, time_bound_s
from chaos.procs import events
from chaos.replay_check import check_replay
from chaos.scenario import NUMERIC, POISON, PREEMPTIONS, SDC, Scenario

__all__ = ["_check"]


def _check(
    sc: Scenario,
    out: Path,
    gold: dict[str, Any],
    planned: list[Planned],
    injected: list[Injected],
    wall: float,
    leftover: bool,
    failures: list[str],
    *,
    exit_code: int | None = None,
) -> dict[str, str]:
    checks: dict[str, str] = {}
    run_dir = out / "run"
    # a. bitwise equal to the golden run (after a bad batch's skip: the skip-golden, whose
    #    key holds the skipped steps); a run stopped by a bad batch has no final state
    digest_file = run_dir / "final_digest.json"
    final = json.loads(digest_file.read_text()) if digest_file.exists() else {}
    digest = final.get("digest")
    checks["a_bitwise_equal"] = "pass" if digest == gold["digest"] else f"fail ({digest})"
    stop = sc.stops_at()
    if stop is not None:
        checks["a_bitwise_equal"] = f"n/a (stopped by the bad batch of step {stop})"
    if sc.hosts == 2:  # the world shrank: float sums differ by design; the run must finish
        shrunk = sc.nproc * (sc.hosts - 1)
        ok = final.get("step") == sc.steps and final.get("world_size") == shrunk
        checks["a_bitwise_equal"] = f"n/a (world {sc.nproc * sc.hosts} -> {shrunk}); finished: " + (
            "pass" if ok else f"fail ({final})"
        )
        if not ok:
            failures.append(f"a: the shrunk run did not finish at step {sc.steps}: {final}")
    resized = any(f.kind == "resize" for f in sc.faults)
    if resized:  # another mesh: sums in another order (chaos/mesh.py); the run must finish
        ok = final.get("step") == sc.steps and final.get("world_size") == worlds(sc)[-1]
        checks["a_bitwise_equal"] = (
            f"n/a (resized, world {' -> '.join(map(str, worlds(sc)))}); finished: "
            + ("pass" if ok else f"fail ({final})")
        )
        if not ok:
            failures.append(f"a: the resized run did not finish at step {sc.steps}: {final}")
    if sc.mesh:  # i. every step trained on the samples the sampler's order gives it
        checks["i_samples"] = check_samples(sc, out / "samples", failures)
    # b. per fault: the restart resumed from the newest checkpoint that was valid at the fault
    #    (b1), and checkpointing had kept up: at most one interval plus one save in flight
    #    behind (b2); a preemption whose save fits the grace loses nothing (b3). Storage
    #    faults that are retried inside the save must not restart anything (b4).
    stdout = out / "stdout.log"
    steps = _attempt_steps(stdout.read_text(errors="replace") if stdout.exists() else "")
    rank0 = list(events(run_dir, 0))  # read once: every check below looks at rank 0's log
    resumes = [  # one per attempt: a hot recovery's resume continues its attempt
        int(e["step"]) for e in rank0 if e.get("event") == "runtime.resume" and not e.get("hot")
    ]
    attempts = len(_inits(run_dir, 0))
    expected_attempts = 1 + sum(1 for p in planned if p.restarts)
    if len(injected) == len(planned) and attempts != expected_attempts:
        failures.append(f"b4: {attempts} attempts, expected {expected_attempts}")
    commits = [
        (_epoch(e["ts"]), int(e["step"])) for e in rank0 if e.get("event") == "ckpt.save.committed"
    ]
    lost: list[int | None] = []
    damaged: dict[int, float] = {}  # step -> when it was damaged
    why: list[str] = []
    for p, inj in zip(planned, injected, strict=False):
        if inj.corrupted_step is not None:
            damaged[inj.corrupted_step] = inj.wall_time
        if inj.kind in ("storage_errors", "storage_latency", "disk_full") and not inj.bit:
            failures.append(f"b: {inj.kind} never reached the storage")
        if not p.restarts:
            lost.append(_hot_lost(p, inj, rank0) if p.expect.split()[0] == "hot" else 0)
            continue
        k = p.attempt
        if k + 1 >= len(resumes) or (inj.completed is None and k >= len(steps)):
            lost.append(None)
            failures.append(f"b: fault at attempt {k} ({inj.kind}) was not followed by a restart")
            continue
        if inj.completed is not None:  # node_loss: rank 0's console may have been on host B
            completed = inj.completed
        else:  # rank 0 prints a step when it is done
            completed = max(steps[k], default=resumes[k] - 1) + 1
        if inj.kind in POISON:  # printed, but its update was dropped: not a step done
            completed = min(completed, p.fault.at_step)
        # (a bitflip's steps up to its replica check were done, then undone: all lost)
        resumed = resumes[k + 1]
        lost.append(completed - resumed)
        before = [(t, st) for t, st in commits if t <= inj.wall_time]
        newest = max((st for _, st in before), default=0)
        valid = [st for t, st in before if st not in damaged or t > damaged[st]]  # re-saved
        # a bitflip: a save started after the last clean check may hold it (check_sdc.py)
        suspect = _suspect(rank0, sc.sdc_check_step(p.fault)) if inj.kind in SDC else set()
        valid = [st for st in valid if st not in suspect]
        newest_valid = max(valid, default=0)
        if inj.kind in PREEMPTIONS:
            if completed != resumed:
                failures.append(
                    f"b3: preemption ({inj.kind}) lost {completed - resumed} steps "
                    f"(stopped after {completed}, resumed at {resumed})"
                )
            continue
        if resumed < newest_valid:
            failures.append(
                f"b1: fault at attempt {k} ({inj.kind}) resumed at {resumed}, older than the "
                f"newest valid checkpoint {newest_valid}"
            )
        # the last save due before the fault; if it had committed intact, the fault may cost
        # less than one interval; if it was still in flight (async) or the fault damaged it,
        # the previous one is what there is
        due = completed // sc.save_every * sc.save_every
        if due in valid and completed - resumed > sc.save_every:
            failures.append(
                f"b0: fault at attempt {k} ({inj.kind}) lost {completed - resumed} steps with "
                f"step {due} committed intact: more than the interval {sc.save_every}"
            )
        # a save that was writing when the fault came may still commit before the group stops
        # (disk_full at 13 while save 12 wrote: 12 committed 11 ms after it, soak 2026-0051
        # of 2026-11-25): the restart has it, so it counts
        newest = max(newest, resumed)
        if completed - newest > 2 * sc.save_every:
            failures.append(
                f"b2: fault at attempt {k} ({inj.kind}) at step {completed} with the newest "
                f"checkpoint at {newest}: more than 2 intervals behind"
            )
        if due and due not in valid:
            refused = inj.kind in SDC and due == completed  # the check before it saw the flip
            state = (
                "damaged"
                if due in damaged
                else "suspect"
                if due in suspect
                else "refused"
                if refused
                else "in flight"
            )
            why.append(f"{inj.kind}: save {due} {state}")
    checks["b_steps_lost"] = f"{lost} (interval {sc.save_every})" + (
        f"; over one interval allowed: {', '.join(why)}" if why else ""
    )
    numeric = [p for p in planned if p.fault.kind in NUMERIC]
    if sc.hot or numeric:  # g. the recovery each fault had, from the events
        failures += _missed_catch_ups(rank0)
        seen = _recoveries(run_dir, planned, injected)
        checks["g_recovery"] = ", ".join(
            f"{p.fault.kind}: {got} (expected {p.expect})"
            for p, got in zip(planned, seen, strict=False)
        )
        for p, got in zip(planned, seen, strict=False):
            if got != p.expect:
                failures.append(
                    f"g: {p.fault.kind} at step {p.fault.at_step}: {got}, expected {p.expect}"
                )
        for p, n in zip(planned, lost, strict=False):
            if p.expect.split()[0] == "hot" and (n is None or n > _HOT_LOST_MAX):
                failures.append(
                    f"g: {p.fault.kind} at step {p.fault.at_step} lost {n} steps hot, more than "
                    f"{_HOT_LOST_MAX} (a snapshot every step, one copy in flight)"
                )
    # c. nothing that failed verification was loaded
    # A load of step S is bad when it came after S was damaged and before S was saved
    # again; a load of S before the damage read it intact.
    loads = [(_epoch(e["ts"]), int(e["step"])) for e in rank0 if e.get("event") == "ckpt.load"]
    damaged_at = {i.corrupted_step: i.wall_time for i in injected if i.corrupted_step is not None}
    loaded_bad = [
        st
        for t, st in loads
        if st in damaged_at
        and t > damaged_at[st]
        and not any(damaged_at[st] < tc < t for tc, resaved in commits if resaved == st)
    ]
    checks["c_no_corrupt_load"] = "pass" if not loaded_bad else f"fail (loaded {loaded_bad})"
    if loaded_bad:
        failures.append(f"c: loaded corrupted checkpoint(s) {loaded_bad}")
    # The damage must have been noticed where it mattered: when the first load after it (a
    # fresh start counts as step 0) came from an older step, the runtime rejected the damaged
    # one and said so. The harness damages the newest commit it sees; a newer one can land
    # between its listing and the kill, and is then loaded intact with no fallback needed.
    fallback_at = [_epoch(e["ts"]) for e in rank0 if e.get("event") == "ckpt.fallback"]
    fresh = [(_epoch(e["ts"]), 0) for e in rank0 if e.get("event") == "ckpt.fresh_start"]
    loads_or_fresh = sorted(loads + fresh)
    for st, td in damaged_at.items():
        first = next(((t, ld) for t, ld in loads_or_fresh if t > td), None)
        if (
            first is not None
            and first[1] < st
            and not any(td < tf <= first[0] for tf in fallback_at)
        ):
            failures.append(
                f"c: step {st} was damaged and the restart loaded {first[1]}, but no fallback "
                "was logged"
            )
    # h. numerical faults: seen and answered as expected, nothing non-finite committed, the
    #    last good checkpoint kept
    if numeric:
        checks.update(_check_numeric(sc, out, numeric, rank0, exit_code, failures))
    # f. replayed steps equal the steps they replay (chaos/replay_check.py)
    # a bitflip's attempt ran the steps from the flip to its check on a corrupted replica
    corrupted = {
        p.attempt: range(p.fault.at_step, sc.sdc_check_step(p.fault))
        for p in planned
        if p.fault.kind in SDC
    }
    checks["f_replay"], replay_failures = check_replay(run_dir, corrupted)
    failures += replay_failures
    # d. within the time bound
    bound_s = time_bound_s(sc, float(gold["wall_s"]))
    checks["d_time"] = f"{wall:.1f} s (bound {bound_s:.0f} s)"
    if wall > bound_s:
        failures.append(f"d: took {wall:.1f} s > bound {bound_s:.0f} s")
    # e. nothing left behind
    checks["e_no_leftover"] = "fail" if leftover else "pass"
    if leftover:
        failures.append("e: processes of the run were still alive after it ended")
    if checks["a_bitwise_equal"] != "pass" and sc.hosts == 1 and stop is None and not resized:
        failures.append(f"a: final digest {digest} != golden {gold['digest']}")
    return checks


def _suspect(rank0: list[dict[str, Any]], at: int) -> set[int]:
    """The steps whose saves the replica mismatch at step `at` named suspect (never loaded
    after it: resilient/runtime/numeric.py)."""
    return {
        int(s)
        for e in rank0
        if e.get("event") == "numeric.sdc" and e.get("step") == at
        for s in e.get("suspect") or ()
    }


_HOT_LOST_MAX = 2
"""Hot mode snapshots every step: a rollback loses the step it failed in, at most one more
when the newest copy was in the making (kill_during_snapshot)."""

_HOT = ("rollback.done", "recovery.hot.formed")
_COLD = ("recovery.cold",)


def _hot_lost(p: Planned, inj: Injected, rank0: list[dict[str, Any]]) -> int | None:
    """Steps a hot recovery gave up: the fault's step back to the snapshot step it rolled
    back to (rollback.done), or what recovery.hot.formed says."""
    for e in rank0:
        if _epoch(e["ts"]) < inj.wall_time - 0.001:
            continue
        if e.get("event") == "rollback.done":
            return max(0, p.fault.at_step - int(e["to_step"]))
        if e.get("event") == "recovery.hot.formed" and e.get("steps_lost") is not None:
            return int(e["steps_lost"])
    return None


def _missed_catch_ups(rank0: list[dict[str, Any]]) -> list[str]:
    """A hot recovery that lost a durable save in flight must save its resumed step before the
    first batch (hot/recovery.py, Resumed.catch_up): it commits, or is found committed already,
    unless a later fault cut it short (that recovery then catches up in its turn)."""
    out = []
    ordered = sorted((e for e in rank0 if "ts" in e), key=lambda e: _epoch(e["ts"]))
    for i, e in enumerate(ordered):
        step = e.get("catch_up_save") if e.get("event") == "recovery.hot.formed" else None
        if step is None:
            continue
        for later in ordered[i + 1 :]:
            name = later.get("event")
            if name in ("ckpt.save.committed", "ckpt.save.skipped") and later["step"] == step:
                break
            if name in ("recovery.hot.formed", "runtime.init"):
                break
        else:
            out.append(f"g: the hot recovery to step {step} lost a save and never saved {step}")
    return out


def _recoveries(run_dir: Path, planned: list[Planned], injected: list[Injected]) -> list[str]:
    """For each fault, what followed it before the next one: "cold" (a new attempt, or a
    recovery.cold event), else "hot" (rollback.done or recovery.hot.formed), else "retry"
    (oom.retry), else "none". A hot try that fell to cold (the same fault twice) is cold."""
    evs = sorted(((_epoch(e["ts"]), e) for e in events(run_dir) if "ts" in e), key=lambda te: te[0])
    out = []
    for i, (p, inj) in enumerate(zip(planned, injected, strict=False)):
        t0 = inj.wall_time - 0.001
        t1 = injected[i + 1].wall_time if i + 1 < len(injected) else float("inf")
        names = {e.get("event") for t, e in evs if t0 <= t < t1}
        new_attempt = any(
            e.get("event") == "runtime.init"
            and int(e.get("restart", 0)) > p.restart
            and int(e.get("generation") or 0) == 0
            for t, e in evs
            if t0 <= t < t1
        )
        if p.fault.kind in NUMERIC:  # rolled back in place (hot) or restarted (cold), and a
            # bad batch, failing again, then skipped or stopped
            cold = new_attempt or bool(names & set(_COLD))
            first = "cold" if cold else "hot" if names & set(_HOT) else "none"
            if p.fault.kind == "bad_batch":
                stopped = any(
                    e.get("event") == "numeric.fault" and e.get("action") == "stop"
                    for t, e in evs
                    if t0 <= t < t1
                )
                then = "skip" if "numeric.skip" in names else "stop" if stopped else "none"
                first = f"{first} then {then}"
            out.append(first)
        elif new_attempt or names & set(_COLD):
            out.append("cold")
        elif names & set(_HOT):
            out.append("hot")
        elif "oom.retry" in names:
            out.append("retry")
        else:
            out.append("none")
    return out
