"""What the tests share: launching processes, waiting for them, reading what runs recorded.

One way to start a process (chaos.procs.spawn: its own session, the checkout on PYTHONPATH)
and one way to kill it (resilient.proctree.kill_tree: the whole tree, workers in sessions of
their own included), the same as the chaos harness:
- `Launcher.run`: a command to completion, output captured, killed at its timeout;
- `start`: a command in the background with its output in a file (a chaos.procs.Run);
- `launch_ranks`: N plain ranks without torchrun (chaos.ranks), each rank's exit code visible.
One `wait_for` (chaos.procs.wait_for): polls, and raises TimeoutError naming what it waited for.

Test modules import from here (and fixtures come from conftest.py), never from each other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos import postmortem
from chaos.forks.wire import PRELOAD_ENV
from chaos.procs import REPO, Run, events, latest_event, resumed_step, spawn, wait_for
from chaos.ranks import Ranks, free_port
from resilient.events import read_events
from resilient.proctree import alive, kill_tree

__all__ = [
    "GUARDED_STEPS",
    "GUARDED_WATCHDOG",
    "GUARDED_WORKER",
    "HANG_WATCHDOG",
    "RANKS_WAIT_S",
    "REPO_ROOT",
    "SUPERVISED_WORKER",
    "WORKERS",
    "ForkedCli",
    "Launcher",
    "Result",
    "exit_events",
    "forks_preloading",
    "free_port",
    "guarded_golden_run",
    "kill_tree",
    "last_by_step",
    "launch_ranks",
    "mark_worker",
    "only_event",
    "read_events",
    "recipe_cmd",
    "records",
    "resumed_step",
    "run_cmd",
    "run_events",
    "spawn",
    "start",
    "wait_for",
    "worker_pids",
]

REPO_ROOT = REPO
WORKERS = Path(__file__).resolve().parent / "workers"
SUPERVISED_WORKER = WORKERS / "supervised_train.py"
"""Appends one JSON line per completed step to <record>/rank<R>.jsonl (`records`)."""
GUARDED_WORKER = "tests/workers/guarded_train.py"
GUARDED_STEPS = 10
"""The guarded worker's schedule in tests/test_hot.py and tests/test_rollback.py, whose
fault-free runs are one per world size and model wrapper for the session (`guarded_golden`)."""
GUARDED_WATCHDOG = {"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 5.0, "timeout_s": 20.0}

Result = tuple[int, str, str]


# ---------------------------------------------------------------------- launching
def forks_preloading(*modules: str) -> Any:
    """A module-scoped autouse fixture: the module's commands fork from a server that
    imported `modules` too (a framework's, about 3 s of CPU a rank otherwise;
    chaos/forks/wire.py PRELOAD_ENV). Assign it to a name in the test module."""

    @pytest.fixture(scope="module", autouse=True)
    def preloading() -> Iterator[None]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(PRELOAD_ENV, ",".join(modules))
            yield

    return preloading


class Launcher:
    """Runs commands to completion with a timeout; kills leftovers on close."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[str]] = []

    def run(self, cmd: list[str], *, timeout: float, env: dict[str, str] | None = None) -> Result:
        """Run `cmd` to completion; return (returncode, stdout, stderr).

        On timeout the whole tree is killed and pytest fails with the output so far.
        """
        proc = spawn(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._procs.append(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stuck = postmortem.describe(proc.pid, _run_dir(cmd))  # before the kill ends it
            kill_tree(proc.pid, groups=(proc.pid,))
            out, err = proc.communicate()
            pytest.fail(
                f"{' '.join(cmd)} timed out after {timeout} s\n--- what it was doing\n"
                f"{stuck[-12000:]}\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}"
            )
        finally:
            kill_tree(proc.pid, groups=(proc.pid,))  # ranks a crashed launcher left behind
        return proc.returncode, out, err

    def close(self) -> None:
        for proc in self._procs:
            kill_tree(proc.pid, groups=(proc.pid,))
            if proc.poll() is None:
                proc.wait(timeout=10)
        self._procs.clear()


def _run_dir(cmd: list[str]) -> Path | None:
    """The `--run-dir` of a `resilient run` command line, if it has one."""
    for i, arg in enumerate(cmd[:-1]):
        if arg == "--run-dir":
            return Path(cmd[i + 1])
    return None


def start(cmd: list[str], log: Path, *, env: dict[str, str] | None = None) -> Run:
    """Start `cmd` in the background, output to `log`; `Run.kill(also=pids)` ends its tree."""
    return Run(cmd, log_path=log, env=env)


# ---------------------------------------------------------------------- the CLI
class ForkedCli:
    """`resilient COMMAND` for each command, side by side, each a process of its own (forked
    by the session's fork server: conftest.py); CompletedProcess results in order. `env` is
    the commands' whole environment (ours when None)."""

    def __call__(
        self, *commands: list[str], env: dict[str, str] | None = None, timeout: float = 50
    ) -> list[subprocess.CompletedProcess[str]]:
        procs = [
            spawn(
                [sys.executable, "-m", "resilient.cli", *args],
                env=dict(os.environ) if env is None else env,
                inherit_env=False,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for args in commands
        ]
        try:
            done = []
            for args, proc in zip(commands, procs, strict=True):
                try:
                    out, err = proc.communicate(timeout=timeout)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"resilient {' '.join(args)} gave no answer in {timeout} s")
                done.append(subprocess.CompletedProcess(args, proc.returncode, out, err))
            return done
        finally:
            for proc in procs:
                kill_tree(proc.pid, groups=(proc.pid,))
                proc.wait(timeout=10)


def mark_worker(worker_id: int) -> None:
    """A user's own worker_init_fn, at module level (workers may pickle it): it marks the
    worker's environment, so a wrapper of the runtime's is seen to still call it."""
    os.environ["SEEN_WORKER"] = str(worker_id)


# ---------------------------------------------------------------------- `resilient run`
def run_cmd(*args: str) -> list[str]:
    """`python -m resilient.cli run ARGS` as an argv list."""
    return [sys.executable, "-m", "resilient.cli", "run", *args]


def recipe_cmd(
    recipe: str, tmp: Path, *flags: str, faults: tuple[str, ...] = (), script: tuple[str, ...] = ()
) -> list[str]:
    """`resilient run` of a recipe on 2 ranks, its run directory and checkpoints under `tmp`,
    restarts without backoff, `flags` for the launcher, `faults` armed by chaos.inject, and
    `--out=tmp` then `script` for the recipe (the framework recipes write tmp/digest.txt)."""
    inject = ["-m", "chaos.inject", *[a for f in faults for a in ("--fault", f)], "--"]
    return run_cmd(
        "--nproc-per-node=2",
        f"--run-dir={tmp / 'run'}",
        f"--checkpoint-url={tmp / 'ckpt'}",
        "--restart-backoff=0",
        "--restart-jitter=0",
        *flags,
        *(inject if faults else []),
        recipe,
        f"--out={tmp}",
        *script,
    )


def tiny_ddp_loop(*, steps: int, sleep_s: float, prelude: str = "") -> str:
    """A small runtime loop (DDP over a 4x4 linear, a save every 5 steps) as a script's text,
    `prelude` before its `resilient.init`."""
    return (
        "import time\nimport torch\nimport resilient\n"
        + prelude
        + "rt = resilient.init(save_every_steps=5)\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))\n"
        "opt = torch.optim.Adam(model.parameters(), lr=0.01)\n"
        "rt.track(model=model, optimizer=opt)\n"
        f"for step in rt.steps(total={steps}):\n"
        "    model(torch.ones(2, 4)).sum().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        f"    time.sleep({sleep_s})\n"
    )


_EXITS_AFTER_INIT = """\
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
with open(sys.argv[1], "a") as f:
    f.write(f"rank {{dist.get_rank()}} attempt {{os.environ['TORCHELASTIC_RESTART_COUNT']}}\\n")
if dist.get_rank() == 0:
    os._exit({code})
time.sleep(50)
"""


def run_rank0_exits(
    launcher: Launcher, tmp: Path, code: int, *, hot: bool, timeout: float
) -> tuple[int, str, Path, list[str]]:
    """`resilient run` (2 ranks, --max-restarts=3, --hot-recovery if `hot`) of a script whose
    rank 0 exits with `code` once the group formed, its peer sleeping. Returns the run's exit
    code, its stderr, its run directory and the sorted "rank R attempt A" lines of every
    start: what a verdict that is never restarted shows."""
    script, starts, run_dir = tmp / "exits.py", tmp / "starts.txt", tmp / "run"
    script.write_text(_EXITS_AFTER_INIT.format(code=int(code)))
    rc, _, err = launcher.run(
        run_cmd(
            "--nproc-per-node=2",
            "--max-restarts=3",
            f"--run-dir={run_dir}",
            *(["--hot-recovery"] if hot else []),
            str(script),
            str(starts),
        ),
        timeout=timeout,
    )
    return rc, err, run_dir, sorted(starts.read_text().splitlines())


def guarded_golden_run(out: Path, nproc: int, *, fsdp: bool) -> str:
    """The guarded worker's fault-free run (micro-batches, GUARDED_STEPS, no snapshots) under
    `resilient run` on `nproc` ranks; returns its final digest. The session runs it once per
    (nproc, fsdp): conftest.py's `guarded_golden`."""
    argv = ["--nproc-per-node", str(nproc), "--run-dir", str(out / "run")]
    argv += ["--monitor-interval", "0.05", GUARDED_WORKER]
    argv += ["--mode", "micro", "--steps", str(GUARDED_STEPS), "--workers", "0"]
    argv += [*(["--fsdp"] if fsdp else []), "--ckpt-dir", str(out / "ckpt")]
    argv += ["--run-dir", str(out / "run")]
    env = {"RESILIENT_WATCHDOG": json.dumps(GUARDED_WATCHDOG)}
    launcher = Launcher()
    try:
        code, _, err = launcher.run(run_cmd(*argv), timeout=150, env=env)
    finally:
        launcher.close()
    assert code == 0, err[-3000:]
    pids = {int(e["pid"]) for e in run_events(out / "run", "runtime.init")}
    left = [p for p in pids if alive(p)]
    assert not left, f"processes left behind: {left}"
    return str(json.loads((out / "run" / "final_digest.json").read_text())["digest"])


def records(record_dir: Path) -> list[dict[str, Any]]:
    """What the supervised worker recorded, every rank, every attempt."""
    return read_events(record_dir, pattern="rank*.jsonl")


def run_events(run_dir: Path, name: str | None = None) -> list[dict[str, Any]]:
    """Events of every log under <run_dir>/logs (the ranks' and the supervisor's), optionally
    only those named `name`; torn lines are skipped."""
    return read_events(run_dir, name)


def worker_pids(run_dir: Path) -> dict[int, int]:
    """rank -> pid of the newest attempt, from the ranks' runtime.init events."""
    pids: dict[int, int] = {}
    for ev in run_events(run_dir, "runtime.init"):
        pids[int(ev["rank"])] = int(ev["pid"])
    return pids


def last_by_step(recs: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Step -> the records of the last attempt that completed it (a replayed step replaces
    what an attempt that failed before checkpointing it had recorded)."""
    by_step: dict[int, dict[str, list[dict[str, Any]]]] = {}
    order: dict[str, float] = {}
    for r in recs:
        by_step.setdefault(r["step"], {}).setdefault(r["attempt"], []).append(r)
        order[r["attempt"]] = min(order.get(r["attempt"], r["t"]), r["t"])
    return {step: per[max(per, key=lambda a: order[a])] for step, per in sorted(by_step.items())}


# ---------------------------------------------------------------------- plain ranks
HANG_WATCHDOG = {
    "heartbeat_interval_s": 0.25,
    "heartbeat_timeout_s": 2.0,
    "timeout_s": 2.0,
    "startup_timeout_s": 30.0,
    "checkpoint_timeout_s": 30.0,
}
"""Detection in seconds: each run ends a few seconds after its fault."""
RANKS_WAIT_S = 90  # process start and torch import dominate; a hang would take the full 1,800 s


def launch_ranks(
    out: Path, faults: list[str], *args: str, watchdog: dict[str, Any] | None = None
) -> tuple[list[int], Ranks]:
    """Run the guarded worker on 3 plain ranks with `faults` (chaos.inject specs); returns
    (exit codes, the finished Ranks) after checking that no process is left."""
    argv = ["-m", "chaos.inject", *[a for f in faults for a in ("--fault", f)], "--"]
    argv += [GUARDED_WORKER, "--ckpt-dir", str(out / "ckpt"), "--run-dir", str(out / "run"), *args]
    env = {"RESILIENT_WATCHDOG": json.dumps({**HANG_WATCHDOG, **(watchdog or {})})}
    ranks = Ranks(3, argv, log_dir=out / "out", env=env)
    try:
        codes = ranks.wait(RANKS_WAIT_S)
        assert_no_process_left(ranks, out / "run")
    finally:
        ranks.kill()  # SIGCONT + SIGKILL whatever is left, a stopped rank included
    return codes, ranks


def assert_no_process_left(ranks: Ranks, run_dir: Path) -> None:
    pids = [e["pid"] for e in events(run_dir) if e.get("event") == "runtime.init"] + ranks.pids
    left = [pid for pid in set(pids) if alive(pid)]
    assert not left, f"processes left behind: {left}"


def only_event(run_dir: Path, name: str) -> dict[str, Any]:
    found = [e for e in events(run_dir) if e.get("event") == name]
    assert len(found) == 1, f"expected one {name} event, got {found}"
    return found[0]


def exit_events(run_dir: Path) -> dict[int, int]:
    return {e["rank"]: e["code"] for e in events(run_dir) if e.get("event") == "watchdog.exit"}


def fault_time(ranks: Ranks, rank: int, kind: str) -> float:
    """When chaos.inject fired `kind` on `rank` (its own record on the rank's stdout)."""
    for line in ranks.output(rank).splitlines():
        if line.startswith("chaos.fault "):
            fault = json.loads(line.split(" ", 1)[1])
            if fault["kind"] == kind:
                return float(fault["time"])
    raise AssertionError(f"rank {rank} never fired its fault:\n{ranks.output(rank)[-3000:]}")


def pid_of(run_dir: Path, rank: int) -> int:
    """The pid of `rank` in the newest attempt (its runtime.init event)."""
    init = latest_event(run_dir, "runtime.init", rank=rank)
    assert init is not None
    return int(init["pid"])
