"""The node gate of `resilient run` (resilient/supervisor/gate.py): the straggler score the
watchdog logs, the eviction rule over it, the health checks' verdict before the first round,
and the operability flags' bad input. `resilient run` stopped by its gate runs through
conftest.py's forked_cli."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from helpers import ForkedCli, run_events

from resilient.errors import ConfigError
from resilient.exitcodes import ExitCode
from resilient.hang.heartbeat import encode_beat, straggler_scores
from resilient.hang.phases import FLAG_WARM, Phase, Progress
from resilient.log import open_event_log
from resilient.supervisor.config import SupervisorConfig, UsageError, parse_command_line
from resilient.supervisor.gate import NodeGate, NodeLeaves
from resilient.supervisor.opsflags import OpsConfig
from resilient.supervisor.report import EventLogs

RECIPE = "recipes/train_ddp.py"


def _beat(local_s: float, *, warm: bool = True, phase: Phase = Phase.FORWARD) -> bytes:
    p = Progress()
    p.local_ema = local_s
    p.phase = phase
    p.flags = FLAG_WARM if warm else 0
    return encode_beat(1, p)


def test_the_straggler_score_is_the_median_pace_over_the_ranks_own() -> None:
    beats = [_beat(0.1), _beat(0.1), _beat(0.3), _beat(0.1, warm=False)]
    scores = straggler_scores(beats, [0, 1, 2, 3])
    assert set(scores) == {0, 1, 2}  # rank 3 is not warm: no pace measured yet
    assert scores[0] == pytest.approx(1.0) and scores[2] == pytest.approx(1 / 3)
    assert straggler_scores([_beat(0.1), _beat(0.2, warm=False)], [0, 1]) == {}


def _scores_log(run_dir: Path, windows: list[dict[str, float]], node_ranks: list[int]) -> None:
    with (run_dir / "logs" / f"rank{node_ranks[0]}.jsonl").open("a") as f:
        for scores in windows:
            ts = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
            f.write(
                json.dumps(
                    {
                        "event": "straggler.scores",
                        "scores": scores,
                        "node_ranks": node_ranks,
                        "ts": ts,
                        "rank": node_ranks[0],
                    }
                )
                + "\n"
            )


def _gate(run_dir: Path, *, min_nodes: int, **ops: object) -> tuple[NodeGate, Path]:
    cfg = SupervisorConfig(
        run_dir=str(run_dir),
        ops=OpsConfig(health_checks=False, evict_stragglers=True, **ops),  # type: ignore[arg-type]
    )
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    log = open_event_log(run_dir / "logs" / "supervisor.jsonl", static={"source": "test"})
    return NodeGate(
        cfg, log=log, logs=EventLogs(run_dir), nproc_per_node=2, min_nodes=min_nodes
    ), run_dir


def test_a_node_whose_rank_stays_slow_for_k_windows_leaves_when_the_world_can_shrink(
    tmp_path: Path,
) -> None:
    gate, run_dir = _gate(tmp_path, min_nodes=1, straggler_windows=3)
    gate.started(world_size=4)  # two nodes of two ranks
    time.sleep(0.01)
    slow = {"0": 1.0, "1": 1.0, "2": 0.4, "3": 1.0}
    _scores_log(run_dir, [slow, slow], node_ranks=[2, 3])
    gate.check()  # two windows of three: stays
    _scores_log(run_dir, [slow], node_ranks=[2, 3])
    with pytest.raises(NodeLeaves) as left:
        gate.check()
    assert left.value.reason == "straggler" and "rank(s) 2" in left.value.detail
    (ev,) = run_events(run_dir, "node.excluded")
    assert ev["reason"] == "straggler" and "0.40" in ev["detail"]


def test_a_straggling_node_stays_when_leaving_would_go_below_min_or_a_window_was_fine(
    tmp_path: Path,
) -> None:
    gate, run_dir = _gate(tmp_path / "a", min_nodes=2, straggler_windows=2)
    gate.started(world_size=4)
    time.sleep(0.01)
    slow = {"0": 1.0, "1": 1.0, "2": 0.3, "3": 1.0}
    _scores_log(run_dir, [slow, slow], node_ranks=[2, 3])
    gate.check()  # two nodes, MIN 2: kept, and said so
    (kept,) = run_events(run_dir, "straggler.kept")
    assert "MIN is 2" in kept["why"]

    gate, run_dir = _gate(tmp_path / "b", min_nodes=1, straggler_windows=2)
    gate.started(world_size=4)
    time.sleep(0.01)
    _scores_log(run_dir, [slow, {**slow, "2": 0.9}], node_ranks=[2, 3])
    gate.check()  # the newest window was fine
    _scores_log(run_dir, [slow], node_ranks=[0, 1])  # another node's ranks are slow, not ours
    gate.check()
    assert not run_events(run_dir, "node.excluded")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--health-check=no-such-cmd-xyz"], "not an executable"),
        (["--health-check="], "is empty"),
        (["--straggler-threshold=-1"], "in (0, 1)"),
        (["--straggler-windows=0"], "must be >= 1"),
        (["--health-check-timeout=0"], "must be > 0"),
        (["--metrics-port=70000"], "0..65535"),
    ],
)
def test_bad_operability_flags_are_usage_errors_that_say_what_to_fix(
    flags: list[str], says: str
) -> None:
    with pytest.raises((UsageError, ConfigError), match=None) as e:
        parse_command_line(["--standalone", *flags, RECIPE])
    assert says in str(e.value)


@pytest.mark.timeout(60)
def test_a_metrics_port_in_use_stops_the_run_before_anything_starts(
    tmp_path: Path, forked_cli: ForkedCli
) -> None:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        (out,) = forked_cli(
            ["run", "--standalone", f"--run-dir={tmp_path / 'run'}", f"--metrics-port={port}",
             RECIPE],
        )  # fmt: skip
    assert out.returncode == ExitCode.USAGE
    assert f"--metrics-port {port}: the port is in use" in out.stderr
    assert not (tmp_path / "run" / "logs").exists()  # nothing started


@pytest.mark.timeout(90)
def test_a_node_failing_its_own_check_at_the_start_exits_excluded_and_says_why(
    tmp_path: Path, forked_cli: ForkedCli
) -> None:
    (out,) = forked_cli(
        ["run", "--standalone", "--nproc-per-node=1", f"--run-dir={tmp_path / 'run'}",
         "--status=off", "--health-check=sh -c 'echo disk is sad >&2; exit 3'", RECIPE,
         "--steps=2"],
        timeout=80,
    )  # fmt: skip
    assert out.returncode == ExitCode.NODE_EXCLUDED, out.stderr[-3000:]
    assert "health check user_command failed" in out.stderr and "disk is sad" in out.stderr
    assert not run_events(tmp_path / "run", "runtime.init")  # no worker ever started
    (done,) = run_events(tmp_path / "run", "health.done")
    assert done["ok"] is False and done["failed"] == ["user_command"]


@pytest.mark.timeout(90)
def test_a_hanging_health_check_times_out_before_anything_starts(
    tmp_path: Path, forked_cli: ForkedCli
) -> None:
    t0 = time.monotonic()
    (out,) = forked_cli(
        ["run", "--standalone", "--nproc-per-node=1", f"--run-dir={tmp_path / 'run'}",
         "--status=off", "--health-check=sleep 60", "--health-check-timeout=1", RECIPE,
         "--steps=2"],
        timeout=80,
    )  # fmt: skip
    assert out.returncode == ExitCode.NODE_EXCLUDED, out.stderr[-3000:]
    assert time.monotonic() - t0 < 30
    assert "timed out after 1" in out.stderr
    assert not run_events(tmp_path / "run", "runtime.init")


def test_no_health_check_with_a_command_of_ones_own_runs_only_that(tmp_path: Path) -> None:
    from resilient.health import HealthInputs, check_node

    log = open_event_log(tmp_path / "logs" / "supervisor.jsonl", static={"source": "test"})
    inputs = HealthInputs(
        run_dir=str(tmp_path), checkpoint_url=None, nproc_per_node=1, user_cmd=("true",)
    )
    report = check_node(dataclasses.replace(inputs, builtin=False), log)
    assert [c.name for c in report.checks] == ["user_command"] and report.ok
    assert len(check_node(inputs, log).checks) == 6  # the built-in ones too
