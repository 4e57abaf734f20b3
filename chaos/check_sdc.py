"""Invariant h for a bitflip: one bit flipped in one DDP replica (silent data corruption).

The runtime (resilient/runtime/numeric.py, `check_replicas`) compares the replicas'
parameter fingerprints every `sdc_every` steps and before every durable save; a mismatch
restarts the group from the newest checkpoint that a later clean check proved, never from a
snapshot (one may hold the flip). A save starts right after its own check passed, and an
async save's staging copy reads the live tensors until the next step's forward: a flip in
that step's `step` or `data` phase may reach it. So every save started after the last clean
check before the mismatch is suspect: `numeric.sdc` names it (`suspect`), the fault's record
(numerical_faults.json) keeps it, and a restart never loads it (`ckpt.suspect_skipped`) until
a replay's save replaced it (`ckpt.save.replace_invalid`). What a run with a flip inside step
S, seen by the check at step count C, the last check before it at step count L (chaos/sdc.py),
must show in rank 0's events:

- one `numeric.sdc` at C, in the flip's attempt, with a fingerprint per rank; three ranks or
  more: `odd_ranks` is exactly the flipped rank (the majority names it), and numeric.fault
  names it alone; two ranks: no majority (`odd_ranks` null), both ranks named, and the
  replay decides;
- `numeric.fault` at C in the phase "replica check", then `numeric.restart` (check_numeric);
- no save of a step after S started in that attempt: the check before the save at C refused
  it, and no save came between S and C (every save is a check);
- `numeric.sdc`'s `suspect` is exactly the steps of the saves started in the flip's attempt
  at L or later (at most the save of L itself, when L is a save step: the one a flip in the
  `step` or `data` phase of step L races; empty when the check at L was the interval's, or
  ran in an earlier attempt);
- each suspect save committed in that attempt (a restart lets a save in flight commit) is
  skipped by the restart (`ckpt.suspect_skipped` names it), and the replay's save of its
  step replaces it (`ckpt.save.replace_invalid`, dir step_<P>);
- the next attempt loaded a checkpoint of a step <= S and below every suspect step (or
  started fresh), and no attempt after the fault ever loaded a checkpoint of a suspect step
  that had not been committed again since;
- the next attempt went past C with no second mismatch there: the flip was transient (with
  two ranks this replay is the decision; a second mismatch at C would be persistent: a stop).

Bitwise equality of the final state with the fault-free run is invariant a.
"""

from __future__ import annotations

from typing import Any

from chaos.plan import Planned
from chaos.scenario import Scenario

__all__ = ["_check_sdc"]


def _attempts(rank0: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Rank 0's events cut at each runtime.init that starts an attempt (a hot replacement,
    generation >= 1, continues its attempt)."""
    out: list[list[dict[str, Any]]] = []
    for e in rank0:
        if e.get("event") == "runtime.init" and int(e.get("generation") or 0) == 0:
            out.append([])
        if out:
            out[-1].append(e)
    return out


def _named(e: dict[str, Any] | None, key: str) -> Any:
    return None if e is None else e.get(key)


def _check_sdc(
    sc: Scenario, planned: list[Planned], rank0: list[dict[str, Any]], failures: list[str]
) -> str:
    """(h) for the bitflips `planned`; a summary per flip, and `failures` extended."""
    from resilient.checkpoint.manifest import step_dir

    world = sc.nproc * sc.hosts
    attempts = _attempts(rank0)
    said = []
    for p in planned:
        f, k = p.fault, p.attempt
        at = sc.sdc_check_step(f)
        here = f"h: bitflip at step {f.at_step} on rank {f.rank}"
        mine = attempts[k] if k < len(attempts) else []
        after = [e for part in attempts[k + 1 :] for e in part]
        sdc = [e for e in rank0 if e.get("event") == "numeric.sdc" and e.get("step") == at]
        ev = sdc[0] if len(sdc) == 1 and sdc[0] in mine else None
        if ev is None:
            failures.append(
                f"{here}: {len(sdc)} replica mismatches (numeric.sdc) at step {at}, expected one "
                f"in attempt {k} (the first check after the flip: sdc_every "
                f"{sc.numeric.get('sdc_every', 100)}, saves every {sc.save_every})"
            )
        # 3+ ranks: the majority names the flipped rank; 2: nobody can (the replay decides)
        odd, ranks = ([f.rank], [f.rank]) if world >= 3 else (None, list(range(world)))
        if ev is not None and (ev.get("odd_ranks") != odd or len(ev["fingerprints"]) != world):
            failures.append(
                f"{here}: numeric.sdc odd_ranks {ev.get('odd_ranks')} of fingerprints "
                f"{ev.get('fingerprints')}, expected {odd} of {world}"
            )
        fault = next(
            (e for e in mine if e.get("event") == "numeric.fault" and e.get("step") == at), None
        )
        if fault is not None and (
            fault.get("phase") != "replica check" or sorted(fault.get("ranks", [])) != ranks
        ):
            failures.append(
                f"{here}: numeric.fault at {at} in phase {fault.get('phase')!r} named ranks "
                f"{fault.get('ranks')}, expected 'replica check' and {ranks}"
            )
        # nothing saved after the flip in its attempt: no checkpoint of a later step holds it
        started = [int(e["step"]) for e in mine if e.get("event") == "ckpt.save.start"]
        late = sorted(set(started) - set(range(f.at_step + 1)))
        if late:
            failures.append(f"{here}: saves of steps {late} started after the flip, before {at}")
        # the saves started since the last clean check before the flip may hold it
        clean = sc.sdc_last_clean_step(f)
        suspect = sorted({s for s in started if clean <= s <= f.at_step})
        named = _named(ev, "suspect")
        if ev is not None and sorted({int(s) for s in named or ()}) != suspect:
            failures.append(
                f"{here}: numeric.sdc at {at} named suspect saves {named}, expected {suspect} "
                f"(saves started in attempt {k} since the last clean check, at {clean})"
            )
        committed = {int(e["step"]) for e in mine if e.get("event") == "ckpt.save.committed"}
        held = [s for s in suspect if s in committed]  # checkpoints that may hold the flip
        # the restart: the suspect checkpoints it skipped, then what it loaded
        skipped_at: set[int] = set()
        start = None
        for e in attempts[k + 1] if k + 1 < len(attempts) else []:
            if e.get("event") == "ckpt.suspect_skipped":
                skipped_at.update(int(s) for s in e.get("steps") or ())
            if e.get("event") in ("ckpt.load", "ckpt.fresh_start"):
                start = e
                break
        skipped = sorted(skipped_at)
        if [s for s in held if s not in skipped]:
            failures.append(
                f"{here}: the restart skipped suspect checkpoints {skipped} "
                f"(ckpt.suspect_skipped), expected {held}, committed after the last clean "
                f"check at {clean}"
            )
        loaded = 0 if _named(start, "event") == "ckpt.fresh_start" else _named(start, "step")
        bound = min([f.at_step + 1, *suspect]) - 1
        if loaded is None or int(loaded) > bound:
            failures.append(
                f"{here}: the restart loaded {loaded}, expected a checkpoint of a step <= "
                f"{bound} (from before the flip"
                + (f", below the suspect save {min(suspect)})" if suspect else ")")
            )
        replaced = {
            str(e.get("dir")) for e in after if e.get("event") == "ckpt.save.replace_invalid"
        }
        kept = [s for s in held if step_dir(s) not in replaced]
        if kept:
            failures.append(
                f"{here}: the replay's saves of suspect steps {kept} did not replace them "
                "(no ckpt.save.replace_invalid)"
            )
        # no attempt after the fault loads a suspect checkpoint not committed again since
        distrusted = set(suspect) | {int(s) for s in named or ()}
        anew: set[int] = set()
        for e in after:
            if e.get("event") == "ckpt.save.committed":
                anew.add(int(e["step"]))
            elif e.get("event") == "ckpt.load" and int(e["step"]) in distrusted - anew:
                failures.append(
                    f"{here}: loaded suspect checkpoint {e['step']}, committed before the "
                    "fault, never saved again"
                )
        again = [e for e in after if e.get("event") == "numeric.sdc" and e.get("step") == at]
        past = any(
            e.get("event") in ("ckpt.save.committed", "runtime.done") and int(e["step"]) >= at
            for e in after
        )
        if again or not past:
            failures.append(
                f"{here}: the replay did not pass the check at {at} "
                f"({'a mismatch again' if again else 'never reached it'})"
            )
        decided = "majority named" if world >= 3 else "no majority, replay decided transient"
        said.append(
            f"bitflip@{f.at_step} rank {f.rank}: seen at {at} "
            f"(odd {_named(ev, 'odd_ranks')}, {decided}), suspect {named} (last clean check "
            f"{clean}), skipped {skipped}, restart from {loaded}, replaced "
            f"{[s for s in held if s not in kept]}, no save after the flip: "
            f"{'fail' if late else 'pass'}"
        )
    return "; ".join(said)
