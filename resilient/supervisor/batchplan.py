"""`resilient run`'s batch flags and its start-up table: on which node counts of
`--nnodes MIN:MAX` the global batch is kept, and what happens on the others.

The launcher knows its node range and processes per node, not the script's loader: the
per-rank batch comes from `--per-rank-batch` or, on a later launch of the same run directory
(a requeue), from what the workers logged (`data.batch`, `data.batch_exact`,
`data.batch_follows`: the global batch they keep, the per-rank batch, the data-parallel degree
and the world size). The global batch is the script's `global_batch_size`, else per-rank batch
x the data-parallel degree of the first round, which the launcher cannot know: the table
assumes MAX nodes (every node started together) unless `--global-batch` or the logs say it.
Without a per-rank batch it says so and what the workers will do instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from resilient import events as ev
from resilient.data.policy import BATCH_POLICIES, DEFAULT_POLICY, split_batch

__all__ = ["BATCH_EVENTS", "add_batch_flags", "plan"]

BATCH_EVENTS = ("data.batch", "data.batch_exact", "data.batch_follows")


def add_batch_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("global batch (docs/operating.md#batch-policy)")
    g.add_argument(
        "--batch-policy",
        choices=BATCH_POLICIES,
        default=None,
        help="when the loader's batch size cannot split the global batch on a new node "
        "count: `exact` keeps it in micro-batches of another size (sample-exact), `follow` "
        f"keeps the per-rank batch (default: the workers', {DEFAULT_POLICY})",
    )
    g.add_argument(
        "--per-rank-batch",
        type=int,
        default=None,
        metavar="B",
        help="the loader's batch size, for the start-up table of node counts",
    )
    g.add_argument(
        "--global-batch",
        type=int,
        default=None,
        metavar="G",
        help="the script's global_batch_size, if it sets one (start-up table only)",
    )


def _logged(run_dir: str) -> dict[str, Any] | None:
    """The newest batch event rank 0 logged in `run_dir` (an earlier attempt of this run)."""
    if not (Path(run_dir) / "logs").is_dir():
        return None
    return ev.latest_event(run_dir, BATCH_EVENTS, rank=0)


def plan(
    args: argparse.Namespace, min_nodes: int, max_nodes: int, nproc: int, run_dir: str
) -> tuple[list[str], dict[str, Any]]:
    """The start-up table's lines and its event's fields (`batch.plan`)."""
    policy = args.batch_policy or DEFAULT_POLICY
    logged = _logged(run_dir)
    per_rank = args.per_rank_batch or (logged or {}).get("per_rank_batch")
    head = f"the global batch on {min_nodes} to {max_nodes} nodes (batch policy {policy})"
    if not per_rank:
        return [
            f"{head}: the per-rank batch is not known before the workers start (pass "
            "--per-rank-batch B to see here which node counts keep the global batch). A node "
            "count whose ranks cannot split it goes on, never exit 80: "
            + (
                "in micro-batches of another size, the same samples (data.batch_exact)"
                if policy == "exact"
                else "with the per-rank batch kept, the global batch following (data.batch_follows)"
            )
        ], {"policy": policy, "per_rank_batch": None}
    ratio = 1.0
    if logged and logged.get("world_size") and logged.get("dp"):
        ratio = int(logged["dp"]) / int(logged["world_size"])  # a mesh's dp share of the world
    dp_max = max(1, int(max_nodes * nproc * ratio))
    if args.global_batch:
        glob, whence = int(args.global_batch), "--global-batch"
    elif logged and (logged.get("global_batch") or logged.get("old_global_batch")):
        glob = int(logged.get("global_batch") or logged["old_global_batch"])
        whence = "the run's last attempt"
    else:
        glob = int(per_rank) * dp_max
        whence = (
            f"{per_rank} per rank x {dp_max} ranks, assumed: the first round forms with "
            f"{max_nodes} nodes and the script sets no global_batch_size"
        )
    lines = [f"{head}: global batch {glob} ({whence})"]
    rows = {}
    for n in range(min_nodes, max_nodes + 1):
        dp = max(1, int(n * nproc * ratio))
        split = split_batch(glob, int(per_rank), dp, policy)
        rows[str(n)] = {"how": split.how, "micro": split.micro, "accum": split.accum}
        lines.append(f"  {n} node(s), {dp} data-parallel rank(s): {split.describe()}")
    lines.append(
        "  (the loop must run rt.grad_accum micro-batches a step: "
        "docs/porting.md#elastic-world-size)"
    )
    fields = {"policy": policy, "per_rank_batch": per_rank, "global_batch": glob, "nodes": rows}
    return lines, fields
