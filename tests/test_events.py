"""The event log is written whatever the user configured, and read back by one module."""

from __future__ import annotations

import logging
from pathlib import Path

import structlog

from resilient import events as ev
from resilient import log


def test_rank_log_is_written_under_a_user_structlog_configuration(
    tmp_path: Path, capsys: object
) -> None:
    seen: list[str] = []

    def user_sink(logger: object, method: str, event_dict: dict[str, object]) -> str:
        seen.append(str(event_dict["event"]))
        raise structlog.DropEvent

    structlog.configure(
        processors=[user_sink],
        wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=logging.CRITICAL, force=True)
    try:
        before = structlog.get_config()
        path = log.configure(run_dir=tmp_path, run_id="r", rank=3, restart=1, console_level="ERROR")
        log.get_logger().info(ev.RUNTIME_INIT, world_size=2)
        log.get_logger().debug("x.debug")
        structlog.get_logger().error("user.event")  # the user's pipeline is theirs
        assert structlog.get_config() == before
        assert seen == ["user.event"]
        assert path == tmp_path / "logs" / "rank3.jsonl" and log.log_path() == path
        got = ev.read_events(tmp_path)
        assert [e["event"] for e in got] == [ev.RUNTIME_INIT, "x.debug"]
        assert got[0]["rank"] == 3 and got[0]["restart"] == 1 and got[0]["world_size"] == 2
        assert ev.timestamp(got[0]) > 0
    finally:
        log.configure(run_dir=None, run_id="r", rank=0, restart=0)
        structlog.reset_defaults()
        logging.basicConfig(level=logging.WARNING, force=True)


def test_readers_skip_torn_lines_and_filter(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.jsonl").write_text(
        '{"event": "a", "rank": 0}\n[1, 2]\n{"event": "b", "rank": 0}\n{"event": "a", "ra'
    )
    (logs / "rank1.jsonl").write_text('{"event": "a", "rank": 1}\n')
    (logs / "chaos.jsonl").write_text('{"event": "chaos.fault"}\n')
    assert len(ev.read_events(tmp_path)) == 4
    assert len(ev.read_events(tmp_path, "a", pattern="rank*.jsonl")) == 2
    assert [e["rank"] for e in ev.read_events(tmp_path, ["a", "b"], rank=0)] == [0, 0]
    assert ev.read_events(logs / "chaos.jsonl")[0]["event"] == "chaos.fault"
    assert ev.read_events(tmp_path / "nowhere") == []
    assert ev.latest_event(tmp_path, "a", where=lambda e: e["rank"] == 1) == {
        "event": "a",
        "rank": 1,
    }
    tail = ev.EventTail(logs)
    assert len(tail.read_new()) == 3  # the torn line waits for its newline
    with (logs / "rank0.jsonl").open("a") as f:
        f.write('nk": 0}\n')
    assert tail.read_new() == [{"event": "a", "rank": 0}] and tail.read_new() == []
