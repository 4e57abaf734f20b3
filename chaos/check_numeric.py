"""Invariant h of chaos/check.py: numerical faults were answered as their scenario expects,
no committed checkpoint holds a non-finite value, and the newest checkpoint from before the
first fault survived retention. A bitflip's own checks are in chaos/check_sdc.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chaos.check_sdc import _check_sdc
from chaos.plan import Planned
from chaos.scenario import SDC, Fault, Scenario

__all__ = ["_check_numeric"]


_FIRST_ACTION = {"hot": "rollback", "cold": "restart"}
"""numeric.fault's action the first time a step fails: rolled back in place from a snapshot
(hot mode), or a cold restart from the newest checkpoint (snapshots off)."""
_CONFIRMS = {"restart": "numeric.restart", "skip": "numeric.skip"}
"""The event each action leads to at the fault's step (a rollback: rollback.done, which (g)
looks for; a stop leaves with exit code 87)."""


def _check_numeric(
    sc: Scenario,
    out: Path,
    planned: list[Planned],
    rank0: list[dict[str, Any]],
    exit_code: int | None,
    failures: list[str],
) -> dict[str, str]:
    """(h) for the numerical faults `planned`: what rank 0 logged about each, the committed
    checkpoints' values, and the newest checkpoint from before the first fault."""
    checks: dict[str, str] = {}
    by_step: dict[int, list[dict[str, Any]]] = {}
    for e in rank0:
        if e.get("event") == "numeric.fault":
            by_step.setdefault(int(e["step"]), []).append(e)
    said = []
    for p in planned:
        f = p.fault
        at = _fault_step(sc, f)
        # "hot" -> [rollback]; "cold then skip" -> [restart, skip]
        words = p.expect.split(" then ")
        want = [_FIRST_ACTION.get(words[0], words[0]), *words[1:]]
        seen = by_step.get(at, [])
        got = [str(e.get("action")) for e in seen]
        check = f" (replica check {at})" if at != f.at_step else ""
        said.append(f"{f.kind}@{f.at_step}{check}: {' -> '.join(got) or 'not seen'}")
        if got != want:
            failures.append(
                f"h: {f.kind} at step {f.at_step}{check}: numeric.fault actions {got}, "
                f"expected {want}"
            )
        if seen and not set(_pipeline(sc, f.rank)) & set(seen[0].get("origin") or []):
            failures.append(
                f"h: {f.kind} poisoned rank {f.rank} at step {f.at_step}; numeric.fault named "
                f"{seen[0].get('origin')}"
            )
        for action in got:
            confirm = _CONFIRMS.get(action)
            if confirm and not any(
                e.get("event") == confirm and e.get("step") == at for e in rank0
            ):
                failures.append(f"h: {f.kind} at step {f.at_step}: {action} but no {confirm}")
        # a step rolled back that then passes was transient; a bad batch's never is
        transient = any(
            e.get("event") == "numeric.transient" and e.get("step") == at for e in rank0
        )
        if transient != (want == ["rollback"]):
            failures.append(
                f"h: {f.kind} at step {f.at_step}: numeric.transient "
                + ("logged for a fault that came back" if transient else "missing")
            )
    injected = {_fault_step(sc, p.fault) for p in planned}
    for step in sorted(set(by_step) - injected):
        failures.append(
            f"h: a numerical fault at step {step} that no injection made (false positive): "
            f"{[e.get('seen') for e in by_step[step]]}"
        )
    stop = sc.stops_at()
    if stop is not None:
        said.append(f"exit {exit_code}")
        if exit_code != sc.expected_exit:
            failures.append(f"h: stopped at step {stop} with exit {exit_code}, expected 87")
    checks["h_numeric"] = ", ".join(said)
    flips = [p for p in planned if p.fault.kind in SDC]
    if flips:
        checks["h_sdc"] = _check_sdc(sc, flips, rank0, failures)
    if sc.storage != "local":
        checks["h_finite_checkpoints"] = "n/a (S3: its server is gone after the run)"
        return checks
    root = out / "ckpt"
    checks["h_finite_checkpoints"], bad = _finite_checkpoints(root)
    failures += [f"h: {b}" for b in bad]
    first = min(injected)
    checks["h_last_good_kept"] = _last_good_kept(root, first, rank0, failures)
    return checks


def _fault_step(sc: Scenario, f: Fault) -> int:
    """The step `numeric.fault` names: the poisoned step, or a bitflip's replica check."""
    return sc.sdc_check_step(f) if f.kind in SDC else f.at_step


def _finite_checkpoints(root: Path) -> tuple[str, list[str]]:
    """Every committed checkpoint under `root` loaded, model and optimizer, each tensor
    checked finite (torch.isfinite), and its manifest's `finite` flag not false."""
    import torch

    from resilient.checkpoint.manifest import MANIFEST_NAME, parse_step_dir
    from resilient.weights.checkpoint_reader import open_checkpoint

    steps = sorted(
        step
        for d in (root.iterdir() if root.is_dir() else [])
        if (step := parse_step_dir(d.name)) is not None and (d / MANIFEST_NAME).exists()
    )
    bad: list[str] = []
    flags = []
    for step in steps:
        try:
            with open_checkpoint(root, step=step) as ckpt:
                flags.append(ckpt.manifest.finite)
                if ckpt.manifest.finite is False:
                    bad.append(f"checkpoint {step}: its manifest says finite=false")
                values: list[tuple[str, Any]] = list(ckpt.read(list(ckpt.specs)).items())
                if ckpt.has_optimizer():
                    values += _tensors("optim", ckpt.read_optimizer(lambda name: name))
        except Exception as e:  # deleted by retention meanwhile, or unreadable: say which
            bad.append(f"checkpoint {step} could not be read: {type(e).__name__}: {e}"[:400])
            continue
        nonfinite = [
            name
            for name, t in values
            if isinstance(t, torch.Tensor)
            and t.is_floating_point()
            and not bool(torch.isfinite(t).all())
        ]
        if nonfinite:
            bad.append(f"checkpoint {step} holds non-finite values in {nonfinite[:5]}")
    marks = sorted({str(f).lower() for f in flags})
    result = f"{len(steps)} loaded {steps} (manifest finite: {'/'.join(marks) or '-'})"
    return (f"fail: {result}" if bad else f"pass: {result}"), bad


def _tensors(prefix: str, value: Any) -> list[tuple[str, Any]]:
    """(dotted path, leaf) of every leaf in nested dicts and lists."""
    if isinstance(value, dict):
        return [kv for k, v in value.items() for kv in _tensors(f"{prefix}.{k}", v)]
    if isinstance(value, list | tuple):
        return [kv for i, v in enumerate(value) for kv in _tensors(f"{prefix}.{i}", v)]
    return [(prefix, value)]


def _last_good_kept(
    root: Path, first: int, rank0: list[dict[str, Any]], failures: list[str]
) -> str:
    """The newest checkpoint committed from before the first numerical fault (at step
    `first`, as numeric.fault names it) is still there, and the fault is recorded in the
    location (numerical_faults.json) that retention reads.

    Checkpoint S holds the state after S steps, so one at the fault's own step is good too;
    retention (resilient/checkpoint/retention.py) keeps the newest at a lower step. Either
    one kept passes: the newest with a step <= the fault's, or else the newest below it. (A
    bitflip's fault step is its replica check's: a checkpoint there was committed only by
    the replay, which passed that check; check_sdc.py asserts no save after the flip.)"""
    from resilient.checkpoint.faults import FAULTS_NAME, first_fault_step, parse_faults
    from resilient.checkpoint.manifest import MANIFEST_NAME, step_dir

    record = root / FAULTS_NAME
    recorded = parse_faults(record.read_bytes(), where=str(record)) if record.exists() else []
    if first_fault_step(recorded) != first:
        failures.append(
            f"h: the first numerical fault was at step {first}; {FAULTS_NAME} records "
            f"{sorted({int(f['step']) for f in recorded})}"
        )
    commits = {int(e["step"]) for e in rank0 if e.get("event") == "ckpt.save.committed"}
    below = max((s for s in commits if s < first), default=None)
    good = [s for s in (first if first in commits else None, below) if s is not None]
    if not good:
        return f"n/a (no checkpoint before step {first})"
    kept = [s for s in good if (root / step_dir(s) / MANIFEST_NAME).exists()]
    if not kept:
        left = sorted(int(d.name.split("_")[1]) for d in root.glob("step_*"))
        failures.append(
            f"h: checkpoint {' or '.join(map(str, good))}, the newest before the first "
            f"numerical fault (step {first}), is gone; left: {left}"
        )
        return f"fail ({' and '.join(map(str, good))} gone)"
    return f"pass (checkpoint {kept[0]} kept; the first fault at step {first})"


def _pipeline(sc: Scenario, rank: int) -> list[int]:
    """The ranks that may be named for a fault poisoned on `rank`: itself, or on a pipelined
    mesh (pp outermost) every stage of its pipeline, since a NaN born in one stage's output
    reaches the loss, where the origin is read, on the last stage."""
    pp = int(sc.mesh.get("pp", 1)) if sc.mesh else 1
    if pp <= 1:
        return [rank]
    per_stage = sc.nproc * sc.hosts // pp
    return [s * per_stage + rank % per_stage for s in range(pp)]
