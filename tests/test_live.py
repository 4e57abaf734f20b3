"""The live view of a run (resilient/live/): following the event logs, the state folded from
them, the Prometheus endpoint scraped over HTTP, the status line, and a real 2-rank run with
a restart whose scraped metrics are checked against its logs."""

from __future__ import annotations

import io
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers import run_cmd, run_events, start, wait_for
from prometheus_client.parser import text_string_to_metric_families

from resilient.events import latest_event
from resilient.live.follow import EventFollower
from resilient.live.goodput import GoodputTracker
from resilient.live.monitor import LiveMonitor
from resilient.live.state import STEP_BUCKETS, LiveState
from resilient.live.status import StatusLine, format_duration, run_status
from resilient.log import open_event_log
from resilient.report.goodput import analyze
from resilient.supervisor.opsflags import OpsConfig

HOST = "node-a"
Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _line(event: str, ts: float, **fields: Any) -> bytes:
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1e6):06d}Z"
    return (json.dumps({**fields, "event": event, "ts": iso}) + "\n").encode()


# ---------------------------------------------------------------------- the follower
@pytest.mark.timeout(10)
def test_follower_reads_complete_lines_new_files_and_torn_lines(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    f = EventFollower(logs)
    assert f.poll() == []
    r0 = logs / "rank0.jsonl"
    second = _line("train.progress", 1000.5, rank=0, first=0, last=0)
    r0.write_bytes(_line("runtime.init", 1000.0, rank=0) + second[:20])
    got = f.poll()
    assert [e["event"] for e in got] == ["runtime.init"] and got[0]["t"] == pytest.approx(1000.0)
    assert f.poll() == []  # the half-written line waits for its newline
    with r0.open("ab") as out:
        out.write(second[20:] + b"not json\n" + b'{"event": "no.ts"}\n')
    got = f.poll()
    assert [(e["event"], e["last"]) for e in got] == [("train.progress", 0)]
    # a new file is picked up; a poll returns its events in time order
    (logs / "supervisor.jsonl").write_bytes(
        _line("attempt.start", 1002.0, source="supervisor") + _line("supervisor.start", 999.0)
    )
    with r0.open("ab") as out:
        out.write(_line("train.progress", 1001.0, rank=0, first=1, last=3))
    assert [e["event"] for e in f.poll()] == ["supervisor.start", "train.progress", "attempt.start"]
    # torn: a killed rank's half line, then the next process's whole event on the same line
    with r0.open("ab") as out:
        out.write(b'{"first": 4, "scores": {"0": 1.0}, "la')
        out.write(_line("runtime.init", 1003.0, rank=0, restart=1, scores={"0": 1.0}))
    assert [(e["event"], e["restart"]) for e in f.poll()] == [("runtime.init", 1)]
    # replaced by a shorter file: read again from its start; removed: forgotten
    r0.write_bytes(_line("runtime.init", 1004.0, rank=0))
    assert [e["t"] for e in f.poll()] == [pytest.approx(1004.0)]
    r0.unlink()
    assert f.poll() == []
    r0.write_bytes(_line("runtime.done", 1005.0, rank=0))
    assert [e["event"] for e in f.poll()] == ["runtime.done"]


# ---------------------------------------------------------------------- a run's logs
def _write_run(run_dir: Path, t: float) -> None:
    """A 2-rank run written through the real event pipeline (resilient.log): attempt 0 saves
    step 4 and loses rank 1; attempt 1 loads step 4, rolls back once in place, retries one
    OOM and ends at step 10 of 10."""
    logs = run_dir / "logs"

    def rank_log(rank: int, restart: int) -> Any:
        static = {"run_id": "r1", "rank": rank, "restart": restart, "pid": 100 * restart + rank}
        return open_event_log(logs / f"rank{rank}.jsonl", static=static, console_level="CRITICAL")

    def window(log: Any, first: int, last: int, t0: float, busy: float) -> None:
        t1 = t0 + busy + 0.01 * (last - first)
        log.info("train.progress", first=first, last=last, t0=t0, t1=t1, t1_first=t0, busy_s=busy)

    sup = open_event_log(
        logs / "supervisor.jsonl",
        static={"source": "supervisor", "run_id": "r1", "host": HOST, "pid": 9},
        console_level="CRITICAL",
    )
    other = open_event_log(
        logs / f"supervisor_{HOST}-b.jsonl",
        static={"source": "supervisor", "run_id": "r1", "host": f"{HOST}-b", "pid": 8},
        console_level="CRITICAL",
    )
    sup.info("supervisor.start")
    for name, ok, value in (("shm", True, "3.1 GiB free"), ("gpu", True, 2), ("user", False, "1")):
        sup.info("health.check", name=name, ok=ok, skipped=name == "gpu", value=value, seconds=0.5)
    sup.info("health.done", ok=False, seconds=1.5, failed=["user"])
    other.info("attempt.start", restart=1)  # another node's supervisor: its own business
    other.info("health.check", name="shm", ok=False, skipped=False, value="0 B", seconds=0.1)
    sup.info("attempt.start", restart=0)
    a = [rank_log(r, 0) for r in (0, 1)]
    for r, log in enumerate(a):
        log.info("runtime.init", world_size=2, local_rank=r, generation=0)
        log.info("runtime.resume", step=0, from_checkpoint=False)
        window(log, 0, 0, t, 0.2)
        window(log, 1, 4, t + 1, 0.4)
        log.info("ckpt.save.committed", step=4, bytes=1000, seconds=0.3 + 0.2 * r)
        window(log, 5, 5, t + 2, 0.1)
    a[0].info("straggler.scores", scores={"0": 1.0, "1": 0.5}, node_ranks=[0, 1])
    for log in a:  # both watchdogs flag rank 1: once
        log.warning("straggler.detected", straggler=1, step=5)
    a[0].info("straggler.cleared", straggler=1, step=6)
    a[1].warning("straggler.detected", straggler=1, step=7)
    a[0].info("hang.timeouts", step=3, timeouts_s={"forward": 9.0, "backward": 5.0})
    a[0].info(
        "hang.timeouts",
        step=5,
        timeouts_s={"forward": 5.0, "backward": 5.0},
        heartbeat_timeout_s=10.4,
    )
    a[0].error("hang.detected", ranks=[1], exit_code=81)
    sup.info("attempt.start", restart=1)
    b = [rank_log(r, 1) for r in (0, 1)]
    for r, log in enumerate(b):
        log.info("runtime.init", world_size=2, local_rank=r, generation=0)
        log.info("ckpt.load", step=4, bytes=1000, seconds=0.25 + 0.1 * r)
        log.info("runtime.resume", step=4, from_checkpoint=True)
        window(log, 4, 7, t + 5, 0.4)
        log.warning("rollback.done", to_step=6, seconds=0.01)
        window(log, 6, 9, t + 6, 0.4)
        log.info("oom.retry", step=9)
        log.info("ckpt.save.committed", step=10, bytes=1100, seconds=0.5)
        log.info("runtime.done", step=10, total=10)
    for log in [*a, *b, sup, other]:
        log.close()


@pytest.mark.timeout(20)
def test_state_from_a_run_written_by_the_event_pipeline(tmp_path: Path) -> None:
    t = time.time() - 60
    _write_run(tmp_path, t)
    events = EventFollower(tmp_path / "logs").poll()
    s = LiveState(host=HOST)
    s.apply_all(events)
    assert s.lead == 0 and s.world_size == 2 and s.attempt == 1 and s.total_steps == 10
    assert {r: x.step for r, x in s.ranks.items()} == {0: 10, 1: 10}
    assert {r: x.steps_run for r, x in s.ranks.items()} == {0: 14, 1: 14}
    assert s.ranks[0].last_step_t == pytest.approx(t + 6.43)
    # histogram: each window's steps at its mean (0.2 -> le 0.25; 0.1 -> le 0.1; 0.4/4 = 0.1)
    assert s.step_count == 28 and s.step_sum == pytest.approx(2 * (0.2 + 0.4 + 0.1 + 0.8))
    assert s.step_buckets[STEP_BUCKETS.index(0.1)] == 26
    assert s.step_buckets[STEP_BUCKETS.index(0.25)] == 2
    # one save per step however many ranks logged it, as slow as its slowest rank
    assert len(s.saves) == 2 and s.save_seconds_sum == pytest.approx(0.5 + 0.5)
    assert s.save_bytes_sum == 2100 and s.checkpoint_step == 10
    assert len(s.loads) == 1 and s.load_seconds_sum == pytest.approx(0.35)
    # recoveries counted on the lead rank alone; restarts and health from this host only
    assert s.recoveries == {
        "cold_restart": 1,
        "hot_replacement": 0,
        "hot_rollback": 1,
        "oom_retry": 1,
    }
    assert s.restarts == 1 and s.hangs == 1
    assert s.hang_timeouts == {"forward": 5.0, "backward": 5.0, "heartbeat": 10.4}  # the newest
    assert s.ranks[1].straggler_score == 0.5 and s.ranks[0].straggler_score == 1.0
    assert s.ranks[1].stragglers_detected == 2  # flagged, cleared, flagged again
    assert {n: (c.ok, c.skipped, c.value) for n, c in s.health.items()} == {
        "shm": (True, False, None),
        "gpu": (True, True, 2.0),
        "user": (False, False, None),
    }
    assert s.health_ok is False and s.health_rounds == {"ok": 0, "failed": 1}
    # goodput: the report's own number on the same files
    clock = [0.0]
    g = GoodputTracker(every_s=10.0, clock=lambda: clock[0])
    g.add(events)
    first = g.update()
    assert first is not None
    assert first.goodput == pytest.approx(analyze(tmp_path).goodput)
    assert first.recoveries == len(analyze(tmp_path).faults)
    g.add([{**events[-1], "t": events[-1]["t"] + 100.0}])
    assert g.update() is first  # not due yet
    clock[0] = 10.0
    assert g.update() is not first


# ---------------------------------------------------------------------- the endpoint
def _scrape(port: int) -> tuple[Scrape, dict[str, str]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    values: Scrape = {}
    helps = {}
    for fam in text_string_to_metric_families(text):
        helps[fam.name] = fam.documentation
        for s in fam.samples:
            values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return values, helps


class _Log:
    def __init__(self) -> None:
        self.said: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.said.append((event, fields))

    warning = info


@pytest.mark.timeout(30)
def test_metrics_are_served_on_port_0_and_scraped_over_http(tmp_path: Path) -> None:
    t = time.time() - 60
    _write_run(tmp_path, t)
    log = _Log()
    ops = OpsConfig(metrics_port=0, metrics_addr="127.0.0.1", status="off")
    mon = LiveMonitor(str(tmp_path), ops, log=log, host=HOST).start()
    try:
        assert mon.port and log.said[0] == (
            "metrics.serving",
            {"port": mon.port, "addr": ops.metrics_addr},
        )
        mon.poll()
        mon.goodput.update(force=True)
        m, helps = _scrape(mon.port)
    finally:
        mon.close()
    for rank in ("0", "1"):
        assert m[("resilient_step", (("rank", rank),))] == 10
        assert m[("resilient_steps_total", (("rank", rank),))] == 14
    assert m[("resilient_last_step_timestamp_seconds", (("rank", "0"),))] == pytest.approx(t + 6.43)
    assert m[("resilient_step_seconds_count", ())] == 28
    assert m[("resilient_step_seconds_bucket", (("le", "0.1"),))] == 26
    assert m[("resilient_step_seconds_bucket", (("le", "+Inf"),))] == 28
    assert m[("resilient_total_steps", ())] == 10 and m[("resilient_attempt", ())] == 1
    assert m[("resilient_goodput", ())] == pytest.approx(analyze(tmp_path).goodput)
    assert m[("resilient_checkpoint_step", ())] == 10
    assert m[("resilient_checkpoint_save_seconds_count", ())] == 2
    assert m[("resilient_checkpoint_save_bytes_sum", ())] == 2100
    assert m[("resilient_checkpoint_last_save_seconds", ())] == 0.5
    assert m[("resilient_checkpoint_load_seconds_sum", ())] == pytest.approx(0.35)
    assert 0 <= m[("resilient_checkpoint_age_seconds", ())] < 120
    assert m[("resilient_restarts_total", ())] == 1
    for kind, n in (("cold_restart", 1), ("hot_replacement", 0), ("hot_rollback", 1)):
        assert m[("resilient_recoveries_total", (("kind", kind),))] == n
    assert m[("resilient_recoveries_total", (("kind", "oom_retry"),))] == 1
    assert m[("resilient_hangs_detected_total", ())] == 1
    assert m[("resilient_hang_timeout_learned_seconds", (("phase", "forward"),))] == 5.0
    assert m[("resilient_hang_timeout_learned_seconds", (("phase", "heartbeat"),))] == 10.4
    assert m[("resilient_straggler_score", (("rank", "1"),))] == 0.5
    assert m[("resilient_stragglers_detected_total", (("rank", "1"),))] == 2
    assert m[("resilient_health_check_ok", (("check", "user"),))] == 0
    assert m[("resilient_health_check_ok", (("check", "shm"),))] == 1
    assert m[("resilient_health_check_value", (("check", "gpu"),))] == 2
    assert m[("resilient_health_ok", ())] == 0
    assert m[("resilient_health_rounds_total", (("result", "failed"),))] == 1
    assert m[("resilient_run_info", (("run_id", "r1"),))] == 1
    assert all(name.startswith("resilient_") and doc for name, doc in helps.items())
    with pytest.raises(urllib.error.URLError):
        _scrape(mon.port)  # closed


# ---------------------------------------------------------------------- the status line
class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.timeout(10)
def test_status_line_plain_and_line_modes() -> None:
    clock = _Clock()
    out = io.StringIO()  # not a terminal: auto is plain
    plain = StatusLine(out, mode="auto", every_s=30.0, prefix="x: ", clock=clock)
    assert plain.mode == "plain" and not plain.show("a")  # the first line after every_s
    clock.now += 30
    assert plain.show("b") and not plain.show("c")
    clock.now += 30
    plain.show("d")
    plain.close("e")
    assert out.getvalue() == "x: b\nx: d\nx: e\n"
    tty = _Tty()
    line = StatusLine(tty, mode="auto", clock=clock)
    assert line.mode == "line"
    line.show("one")
    clock.now += 0.5
    assert not line.show("two")  # at most once a second
    clock.now += 0.5
    line.show("three")
    line.clear_for_others()
    line.close("last")
    assert tty.getvalue() == "\r\x1b[Kone\r\x1b[Kthree\r\x1b[K\r\x1b[Klast\n"
    r, w = os.pipe()
    with os.fdopen(w, "w") as pipe:
        assert StatusLine(pipe, mode="auto").mode == "plain"
    os.close(r)
    off = io.StringIO()
    StatusLine(off, mode="off").close("nothing")
    assert off.getvalue() == ""
    assert (format_duration(5), format_duration(125), format_duration(7300)) == (
        "5s",
        "2m05s",
        "2h01m",
    )
    said = run_status(
        step=40,
        total=100,
        rate=2.0,
        checkpoint_step=30,
        checkpoint_age_s=75,
        goodput=0.912,
        recoveries={"cold_restart": 1, "oom_retry": 0},
        ranks=2,
    )
    assert said == (
        "step 40/100 (2 ranks) | 2 steps/s | ETA 30s | ckpt 30 (1m15s ago) | goodput 91.2% | "
        "recoveries 1 (1 cold restart)"
    )
    unknown = run_status(
        step=40, total=None, rate=2.0, checkpoint_step=None, checkpoint_age_s=None,
        goodput=None, recoveries={},
    )  # fmt: skip
    assert unknown == "step 40 | 2 steps/s | no ckpt yet | recoveries 0"


@pytest.mark.timeout(10)
def test_the_line_clears_itself_before_this_process_writes_to_stderr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    line = StatusLine(mode="line")
    line.own_stderr()
    assert sys.stderr is not tty
    line.show("status")
    print("an event", file=sys.stderr)
    line.close("done")
    assert sys.stderr is tty
    assert tty.getvalue() == "\r\x1b[Kstatus\r\x1b[Kan event\n\r\x1b[Kdone\n"


@pytest.mark.timeout(20)
def test_the_monitor_prints_the_run_status_when_it_closes(tmp_path: Path) -> None:
    _write_run(tmp_path, time.time() - 60)
    out = io.StringIO()
    ops = OpsConfig(status="plain", status_every_s=3600)
    mon = LiveMonitor(str(tmp_path), ops, out, host=HOST, poll_s=0.05).start()
    assert mon.port is None
    mon.close()
    text = out.getvalue()
    assert text.startswith("resilient: step 10/10 (2 ranks) | ") and text.count("\n") == 1
    assert "ckpt 10 (" in text and "goodput " in text
    assert "recoveries 3 (1 cold restart, 1 hot rollback, 1 oom retry)" in text


# ---------------------------------------------------------------------- a real run
def _try_scrape(port: int) -> Scrape | None:
    try:
        return _scrape(port)[0]
    except (OSError, urllib.error.URLError):
        return None  # not up yet, or the run just ended


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_real_run_serves_metrics_that_match_its_logs(tmp_path: Path) -> None:
    """2 ranks, rank 1 killed at step 6 (a cold restart from step 4), every step slowed to
    0.4 s in every attempt so the run outlives a few scrapes after the restart."""
    run_dir, ckpt = tmp_path / "R", tmp_path / "D"
    cmd = run_cmd(
        "--standalone", "--nproc-per-node=2", "--max-restarts=3", "--metrics-port=0",
        "--status=plain", "--status-every=1", f"--run-dir={run_dir}",
        "-m", "chaos.inject", "--fault", "kill@rank=1,step=6",
        "--fault", "slow@phase=forward,seconds=0.4,restart=any", "--",
        "recipes/train_ddp.py", "--steps", "14", "--save-every", "4", "--corpus-chars", "20000",
        "--batch-size", "8", f"--ckpt-dir={ckpt}", f"--run-dir={run_dir}",
    )  # fmt: skip
    run = start(cmd, tmp_path / "out.log")
    scrapes: list[Scrape] = []
    try:
        serving = wait_for(
            lambda: latest_event(run_dir, "metrics.serving"), timeout=60, what="metrics.serving"
        )
        port = int(serving["port"])

        def after_restart() -> Scrape | None:
            m = _try_scrape(port)
            if m is not None:
                scrapes.append(m)
                if m.get(("resilient_recoveries_total", (("kind", "cold_restart"),))):
                    return m
            return None

        mid = wait_for(after_restart, timeout=90, poll=0.2, what="a scrape after the restart")
        for _ in range(3):  # a few more during the second attempt
            time.sleep(0.5)
            after_restart()
        rc = run.wait(90)
    finally:
        run.kill()
    out = (tmp_path / "out.log").read_text(errors="replace")
    assert rc == 0, out[-4000:]
    # the logs at the end, and what was scraped before it
    restarts = [e for e in run_events(run_dir, "attempt.start") if e["restart"] > 0]
    assert mid[("resilient_restarts_total", ())] == len(restarts) == 1
    assert mid[("resilient_attempt", ())] == 1
    committed = {int(e["step"]) for e in run_events(run_dir, "ckpt.save.committed")}
    assert max(committed) == 14
    progress = run_events(run_dir, "train.progress")
    resumed = run_events(run_dir, "runtime.resume")
    for m in scrapes:
        assert m.get(("resilient_restarts_total", ()), 0) <= 1
        if ("resilient_checkpoint_step", ()) in m:
            assert m[("resilient_checkpoint_step", ())] in committed
        for rank in (0, 1):
            step = m.get(("resilient_step", (("rank", str(rank)),)))
            logged = {e["last"] + 1 for e in progress if e["rank"] == rank}
            logged |= {e["step"] for e in resumed if e["rank"] == rank}
            assert step is None or (step in logged and step <= max(logged)), (rank, step)
        assert m[("resilient_step_seconds_count", ())] <= sum(
            e["last"] - e["first"] + 1 for e in progress
        )
    assert mid[("resilient_checkpoint_step", ())] in committed - {14}
    assert mid[("resilient_checkpoint_save_seconds_count", ())] <= len(
        {(e["restart"], e["step"]) for e in run_events(run_dir, "ckpt.save.committed")}
    )
    # the status: plain lines during the run, the last one once it is over
    status = [ln for ln in out.splitlines() if ln.startswith("resilient: step")]
    assert len(status) >= 2, out[-4000:]
    assert status[-1].startswith("resilient: step 14/14 (2 ranks)")
    assert "recoveries 1 (1 cold restart)" in status[-1] and "ckpt 14 (" in status[-1]
