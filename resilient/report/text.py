"""`resilient report`'s text: a RunReport as the lines a person reads."""

from __future__ import annotations

from resilient.report.results import RunReport

__all__ = ["format_report"]


def format_report(rep: RunReport) -> str:
    def s(x: float | None, unit: str = " s", digits: int = 2) -> str:
        return "-" if x is None else f"{x:.{digits}f}{unit}"

    lines = [
        f"wall time            {s(rep.wall_s)}  (start-up {s(rep.startup_s)}, end {s(rep.end_s)})",
        f"productive step time {s(rep.productive_s)}  (replayed {s(rep.replayed_s)}, "
        f"slowed by saves {s(rep.save_slowdown_s)})",
        f"goodput              {rep.goodput:.3f}  "
        f"(without start-up and end {rep.steady_goodput:.3f})",
        f"final step           {rep.final_step}  ({rep.attempts} attempt(s), {rep.saves} saves)",
        f"median step          {s(rep.step_s, ' s', 4)}  "
        f"(between steps {s(rep.step_overhead_s, ' s', 4)})",
        f"save cost ({rep.save_cost_basis})  {s(rep.save_cost_s, ' s', 4)}  "
        f"(blocked {s(rep.blocked_s, ' s', 4)}, measured interval {s(rep.interval_s)})",
    ]
    if rep.hang_timeouts or rep.hang_pinned:
        learned = ", ".join(f"{k} {v:g} s" for k, v in rep.hang_timeouts.items()) or "none"
        pinned = ", ".join(rep.hang_pinned) or "none"
        lines.append(f"hang timeouts        learned: {learned}; pinned: {pinned}")
    if rep.replay_verified or rep.replay_diverged:
        steps = sum(n for _, n in rep.replay_verified)
        ranks = len({r for r, _ in rep.replay_verified})
        lines.append(
            f"replay check         {len(rep.replay_verified)} resume(s) verified on {ranks} "
            f"rank(s), {steps} replayed step(s) identical"
        )
        for d in rep.replay_diverged:
            lines.append(
                f"  DIVERGED: rank {d.get('rank')} at step {d.get('step')}: the "
                f"{d.get('differed')} differ from the earlier attempt's; {d.get('causes')}"
            )
    if rep.numeric:
        head = "numerical fault  step  origin   " + f"{'seen':<40}  action"
        lines += ["", head]
        for i, e in enumerate(rep.numeric):
            seen = "; ".join(sorted({w for ws in e.get("seen", {}).values() for w in ws}))
            origin = ",".join(str(r) for r in e.get("origin", e.get("ranks", [])))
            lines.append(
                f"{i:>15}  {e.get('step', '-'):>4}  {origin:<7}  {seen[:40]:<40}  "
                f"{e.get('action')} (seen {e.get('times_seen', 1)}x)"
            )
        if rep.skipped:
            said = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in rep.skipped)
            lines.append(f"skipped steps        {said}")
        suspect = {r: n for r, n in rep.suspects.items() if n > 1}
        if rep.suspects:
            lines.append(
                "transient origins    "
                + ", ".join(f"rank {r}: {n}" for r, n in sorted(rep.suspects.items()))
                + (f"  SUSPECT: {sorted(suspect)}" if suspect else "")
            )
    if rep.faults:
        lines += [
            "",
            "fault  kind              recovery           detect   restored    recover  steps lost",
        ]
        for i, f in enumerate(rep.faults):
            lost = "-" if f.steps_lost is None else str(f.steps_lost)
            note = "" if f.exact_time else "  (fault time estimated from the logs)"
            note += f"  timeout: {f.timeout}" if f.timeout else ""
            lines.append(
                f"{i:>5}  {f.label:<16}  {f.recovery:<16} {s(f.detect_s):>8} {s(f.restart_s):>10} "
                f"{s(f.recover_s):>10}  {lost:>10}{note}"
            )
        kinds = sorted({f.recovery for f in rep.faults})
        lines.append(
            "recoveries           "
            + ", ".join(f"{sum(f.recovery == k for f in rep.faults)} {k}" for k in kinds)
        )
    for m in rep.membership:
        lines.append(
            f"membership change    a node joined (not a fault): the group saved and restarted, "
            f"its next step {s(m.recover_s)} after the agent's decision, steps lost "
            + ("-" if m.steps_lost is None else str(m.steps_lost))
        )
    if rep.optimal_goodput is not None:
        ratio = rep.goodput_over_optimum
        run_opt = rep.optimal_run_goodput
        lines += [
            "",
            f"Young/Daly: MTBF {s(rep.mtbf_s)}, save cost {s(rep.save_cost_s, ' s', 4)}, "
            f"restart cost {s(rep.restart_cost_s)}",
            f"  optimal interval {s(rep.optimal_interval_s)}, optimal goodput "
            f"{rep.optimal_goodput:.3f} (steady state), "
            + ("-" if run_opt is None else f"{run_opt:.3f}")
            + " with this run's start-up and end",
            "  measured/optimum " + ("-" if ratio is None else f"{ratio:.3f}"),
        ]
    return "\n".join(lines)
