"""`resilient report --png`: a run's timeline (steps, saves, faults, restarts per rank)."""

from __future__ import annotations

from pathlib import Path

from resilient import events as ev
from resilient.report.logs import load_events

__all__ = ["plot_timeline"]


def plot_timeline(run_dir: str | Path, out_png: str | Path) -> Path:
    """Draw steps, saves, faults and restarts per rank over time into a PNG."""
    import matplotlib  # optional dependency: the "report" extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = load_events(run_dir)
    t0 = min(e["t"] for e in events)
    ranks = sorted(
        {int(e["rank"]) for e in events if "rank" in e}
        # a fault's target gets its row even when its own log is missing (killed early)
        | {int(e.get("target_rank", 0)) for e in events if e.get("event") == "chaos.fault"}
    )
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * len(ranks)))
    for e in events:
        r = int(e.get("rank", -1))
        if e.get("event") == "train.progress":
            ax.broken_barh(
                [(float(e["t0"]) - t0, float(e["t1"]) - float(e["t0"]))],
                (r - 0.3, 0.6),
                color="tab:green",
            )
        elif e.get("event") == "ckpt.save.committed":
            ax.broken_barh(
                [(e["t"] - t0 - float(e["seconds"]), float(e["seconds"]))],
                (r - 0.45, 0.15),
                color="tab:blue",
            )
        elif e.get("event") == "runtime.init" and int(e.get("restart", 0)) > 0:
            ax.axvline(e["t"] - t0, color="grey", linestyle="--", linewidth=0.8)
        elif e.get("event") in (ev.ROLLBACK_DONE, ev.RECOVERY_HOT_FORMED) and r == 0:
            ax.axvline(e["t"] - t0, color="tab:purple", linestyle=":", linewidth=1.0)
        elif e.get("event") == "numeric.fault":  # at each origin rank: what it saw
            for o in e.get("origin", e.get("ranks", [r])):
                ax.plot(e["t"] - t0, int(o), marker="D", color="black", markersize=6)
        elif e.get("event") == "numeric.skip" and r == 0:
            ax.axvline(e["t"] - t0, color="black", linestyle="-.", linewidth=0.8)
        elif e.get("event") in ev.DETECTION:
            ax.plot(e["t"] - t0, r, marker="v", color="tab:orange")
        elif e.get("event") == "chaos.fault":
            ax.plot(
                e["t"] - t0,
                int(e.get("target_rank", 0)),
                marker="X",
                color="tab:red",
                markersize=10,
            )
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(min(ranks) - 0.7, max(ranks) + 0.7)
    ax.set_xlabel("seconds since start")
    ax.set_title(
        "steps (green), saves (blue), faults (red X), detections (orange), numerical faults "
        "(black diamond), skips (dash-dot), cold restarts (dashed), hot recoveries (dotted)",
        fontsize=9,
    )
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
