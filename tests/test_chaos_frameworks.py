"""The framework soak's draws and its left-behind check (chaos/frameworks.py); the soak itself
runs in `make soak`."""

from __future__ import annotations

import json
import random
from pathlib import Path

from chaos.faults import parse
from chaos.frameworks import command, draw, logged_pids


def _draws(seed: int) -> list:
    rng = random.Random(seed)
    return [draw(rng) for _ in range(200)]


def test_draws_are_seeded_and_every_fault_parses() -> None:
    first = _draws(5)
    assert first == _draws(5) != _draws(6)
    assert {d.recipe for d in first} == {"hf", "lightning", "accelerate"}
    assert any(d.hot for d in first) and any(d.fsdp for d in first)
    for d in first:
        assert not (d.hot and d.fsdp)
        assert d.fsdp <= (d.recipe == "lightning")
        for spec in d.faults:
            fault = parse(spec)
            assert fault.step is not None and 1 <= fault.step < d.steps - 1


def test_the_command_arms_the_faults_and_the_recipes_options(tmp_path: Path) -> None:
    d = draw(random.Random(0))
    cmd = command(d, tmp_path, d.faults)
    assert cmd[cmd.index("-m", 3) + 1] == "chaos.inject"
    assert f"--grad-accum={d.grad_accum}" in cmd and f"--steps={d.steps}" in cmd
    assert ("--hot-recovery" in cmd) == d.hot
    assert "chaos.inject" not in command(d, tmp_path, [])


def test_every_pid_the_logs_name_is_found(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "supervisor.jsonl").write_text(
        json.dumps({"event": "attempt.start", "pid": 10, "pids": [11, 12]}) + "\n"
    )
    (logs / "rank0.jsonl").write_text(json.dumps({"event": "runtime.init", "pid": 11}) + '\n{"ev')
    assert logged_pids(tmp_path) == {10, 11, 12}
