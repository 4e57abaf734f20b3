"""Chaos scenarios: a run of a recipe plus a schedule of faults, kept as small TOML files.

    name = "kill-rank1"
    recipe = "train_ddp.py"
    steps = 24
    save_every = 4

    [[fault]]
    kind = "kill"        # see FAULT_KINDS
    rank = 1
    at_step = 10         # when rank 0 has printed this step

A seeded generator makes random schedules for soak runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.mesh import check_mesh, describe, worlds
from chaos.mesh import toml_value as _toml_value

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = [
    "FAULT_KINDS",
    "HOT_KINDS",
    "HOT_ONLY",
    "LOST_PROCESS",
    "NUMERIC",
    "POISON",
    "SDC",
    "Fault",
    "Scenario",
    "expected_recovery",
    "replaces_process",
]

FAULT_KINDS = {
    "kill": "SIGKILL one worker",
    "sigstop": "SIGSTOP one worker (a hang the rank cannot report itself)",
    "sigterm": "SIGTERM to the launcher (a spot preemption); the run is launched again",
    "sigterm_rank": "SIGTERM to one worker; the run is launched again",
    "raise": "RuntimeError raised inside one rank at (step, phase)",
    "oom": "torch.OutOfMemoryError raised inside one rank at (step, phase)",
    "hang": "one rank's main thread sleeps for ever at (step, phase)",
    "corrupt": "flip a byte in a data file of the newest checkpoint, then SIGKILL a worker",
    "truncate": "cut a data file of the newest checkpoint in half, then SIGKILL a worker",
    "delete": "delete a data file of the newest checkpoint, then SIGKILL a worker",
    "kill_during_save": "SIGKILL a worker while a checkpoint is being written",
    "storage_errors": "the S3 proxy answers the next `count` writes with 503 SlowDown",
    "storage_latency": "the S3 proxy holds the next `count` writes for `seconds` each",
    "disk_full": "fill the checkpoint disk (a tmpfs) until a save fails, then free it",
    "node_loss": "kill -9 every process of the second host (a network namespace of its own) "
    "in a two-host run; the first host goes on alone",
    "raise_twice": "the same RuntimeError twice at the same (rank, step, phase): in hot mode "
    "the first is rolled back in place, the second must go cold",
    "oom_exit": "one worker exits with the OOM exit code (os._exit) at (step, phase): a lost "
    "process, as the kernel's OOM killer or a CUDA abort would leave it",
    "kill_during_snapshot": "one worker SIGKILLs itself halfway through its in-memory "
    "snapshot after step `at_step` (hot mode takes one every step)",
    "kill_with_buddy": "SIGKILL a worker and its buddy (the next rank) at once: hot recovery "
    "must fall back to cold",
    "kill_during_replication": "one worker SIGKILLs itself while its snapshot after step "
    "`at_step` goes to its buddy (FSDP2 under hot recovery): the buddy's replica of it is "
    "incomplete",
    "nan": "the model's output (so the loss) becomes NaN in one rank's forward of `at_step`, "
    "once: a transient numerical fault, rolled back in place (hot) or restarted (cold)",
    "spike": "the model's output is scaled by `factor` (default 1000) in one rank's forward "
    "of `at_step`, once: a loss spike (needs numeric.spike_factor below the spike)",
    "bad_batch": "NaN (or a spike by `factor`) in that forward every time step `at_step` "
    "runs, in every attempt: a persistent numerical fault; numeric policy skip drops the "
    "step's update and goes on, stop ends the run with ExitCode.NUMERICAL_FAULT (87)",
    "bitflip": "one bit flipped in one parameter of one DDP rank at (step, phase), once: "
    "silent data corruption of one replica, seen by the replica check (numeric.sdc) at its "
    "first check after it and restarted from the newest checkpoint that a later clean check "
    "proved (one saved after the last clean check before it is suspect, never loaded)",
    "resize": "SIGKILL the whole launch at `at_step` and launch again on the fault's `mesh` "
    "(train_nd.py): a restart on another mesh, resharded, at the exact sample (chaos/mesh.py)",
}
POISON = {"nan", "spike", "bad_batch"}
"""The model's output poisoned in one forward; the runtime's numeric checks see them before
`optimizer.step()` (resilient/numeric/)."""
SDC = {"bitflip"}
"""Silent data corruption: finite and wrong; only the DDP replica check (numeric.sdc) sees
it, every `sdc_every` steps and before every save (chaos/sdc.py)."""
NUMERIC = POISON | SDC
"""Numerical faults (issue 27)."""
IN_PROCESS = NUMERIC | {
    "raise",
    "oom",
    "hang",
    "raise_twice",
    "oom_exit",
    "kill_during_snapshot",
    "kill_during_replication",
}
"""Installed inside the ranks by `python -m chaos.inject`, not sent from outside."""
PREEMPTIONS = {"sigterm", "sigterm_rank"}
"""End the launch with ExitCode.PREEMPTED; the runner launches the same command again."""
NO_RESTART = {"storage_errors", "storage_latency"}
"""Retried inside the save: the run goes on without a restart."""
S3_ONLY = {"storage_errors", "storage_latency"}
TWO_HOSTS = {"node_loss"}
"""Need `hosts = 2`; a two-host scenario has only these."""
_PHASES = ("data", "forward", "backward", "optimizer", "step")
HOT_ONLY = {
    "raise_twice",
    "oom_exit",
    "kill_during_snapshot",
    "kill_with_buddy",
    "kill_during_replication",
}
"""Kinds of hot mode that the cold draw leaves out, so a seed's cold schedules stay as
they were before hot mode existed."""
LOST_PROCESS = {
    "kill",
    "kill_during_save",
    "oom_exit",
    "kill_during_snapshot",
    "kill_with_buddy",
    "kill_during_replication",
    "hang",
    "sigstop",
}
"""In hot mode these need `resilient run --hot-recovery` (a warm replacement); without it
a hot scenario that has one is skipped, with the reason. A hung or stopped rank is one: the
watchdog's hot verdict takes it out alone (hang/verdict.py), and it is replaced."""
HOT_KINDS = {"raise", "oom", "raise_twice"} | LOST_PROCESS
"""The faults a hot-mode scenario may have (issue 10, item 5)."""
_IN_STEP = ("forward", "backward")
"""Where rt.micro_batches can catch an in-process fault (the guard's in-place agreement)."""


def expected_recovery(
    f: Fault, hot: bool, recipe: str = "train_ddp.py", *, policy: str = "stop"
) -> str:
    """What must follow fault `f`: "hot" (rolled back in place, or a warm replacement),
    "retry" (the OOM guard retried the batch in smaller parts), "cold" (a restart of the
    group) or "none" (a storage fault retried inside the save). A `bad_batch` fails its step
    again after the first recovery (hot or cold): "hot then skip", "cold then stop" and so
    on, the second word from the numeric `policy`."""
    if f.kind in NO_RESTART:
        return "none"
    if f.kind in SDC:  # snapshots may hold the flip: always from a checkpoint a check proved
        return "cold"
    if f.kind in NUMERIC:  # no exception: the step loop rolls back (snapshots on) or leaves
        first = "hot" if hot else "cold"
        if f.kind == "bad_batch":
            return f"{first} then {'skip' if policy == 'skip' else 'stop'}"
        return first
    if not hot or f.kind in ("raise_twice", "kill_with_buddy", "resize"):
        return "cold"
    if f.kind in ("raise", "oom"):  # only the DDP recipe steps through rt.micro_batches
        if f.phase not in _IN_STEP or recipe != "train_ddp.py":
            return "hot"  # no in-place agreement there: the rank is replaced warm
        return "retry" if f.kind == "oom" else "hot"
    return "hot" if f.kind in LOST_PROCESS else "cold"


def replaces_process(f: Fault, hot: bool, recipe: str = "train_ddp.py") -> bool:
    """Fault `f` is recovered hot by a new process in its rank's place (a new generation):
    a lost process, or an in-process fault that no in-place agreement catches. A numerical
    fault never is: every rank rolls back in place, at the end of its step."""
    if f.kind in NUMERIC or expected_recovery(f, hot, recipe) != "hot":
        return False
    return f.kind in LOST_PROCESS or f.phase not in _IN_STEP or recipe != "train_ddp.py"


@dataclass(kw_only=True, slots=True)
class Fault:
    kind: str
    """One of FAULT_KINDS."""
    rank: int = 1
    """The worker that gets the signal."""
    at_step: int = 8
    """Inject once rank 0 has run this step (in the current attempt); in-process faults
    fire when the rank enters `phase` of this step."""
    phase: str = "forward"
    """For in-process faults: data, forward, backward, optimizer or step."""
    count: int = 4
    """For storage faults: how many requests fail or are held."""
    seconds: float = 1.0
    """For storage_latency: how long each request is held."""
    factor: float | None = None
    """For spike and bad_batch: the scale of the model's output in the poisoned forward
    (spike: 1000 when not given; bad_batch without it: NaN)."""
    mesh: dict[str, int] | None = None
    """For resize: the mesh of the launch after it (chaos/mesh.py's DIMS)."""

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; known: {sorted(FAULT_KINDS)}")
        if self.kind in POISON and self.phase != "forward":
            raise ValueError(
                f"{self.kind} poisons the model's output: phase must be forward, got {self.phase!r}"
            )
        spiky = self.kind in ("spike", "bad_batch")
        if self.factor is not None and (not spiky or self.factor <= 1):
            raise ValueError(f"factor is for spike and bad_batch, and > 1 (got {self.factor})")
        if self.at_step < 1:
            raise ValueError(f"at_step must be >= 1, got {self.at_step}")
        if self.phase not in _PHASES:
            raise ValueError(f"phase must be one of {_PHASES}, got {self.phase!r}")
        if self.count < 1 or self.seconds < 0:
            raise ValueError(f"count must be >= 1 and seconds >= 0 ({self.count}, {self.seconds})")

    @property
    def restarts(self) -> bool:
        """Ends the attempt: the group restarts (or, for a preemption, is launched again)."""
        return self.kind not in NO_RESTART

    @property
    def spike_scale(self) -> float | None:
        """The output's scale when this fault is a loss spike (None: NaN, or not numeric)."""
        if self.kind == "spike":
            return _SPIKE_FACTOR if self.factor is None else self.factor
        return self.factor if self.kind == "bad_batch" else None


SDC_PHASES = _PHASES
"""Where a bitflip may fire: every phase. In `step` and `data` (before the fence on an async
save's copy) it may reach the save before it, which the runtime then names suspect and never
loads (chaos/sdc.py, chaos/check_sdc.py)."""
_SPIKE_FACTOR = 1000.0
"""chaos/faults.py's default scale for a spike."""


@dataclass(kw_only=True, slots=True)
class Scenario:
    name: str
    recipe: str = "train_ddp.py"
    nproc: int = 2
    """Workers per host."""
    hosts: int = 1
    """1, or 2: two network namespaces on this machine (root only), one agent each, rendezvous
    on the first; the world may shrink to the first host when the second is lost."""
    steps: int = 24
    save_every: int = 4
    workers: int = 0
    seed: int = 1234
    corpus_chars: int = 20_000
    max_restarts: int = 4
    storage: str = "local"
    """Where checkpoints go: "local" (a directory; a small tmpfs when a disk_full fault is
    scheduled) or "s3" (moto's server on loopback, behind the fault proxy)."""
    grace_s: float = 30.0
    """The preemption grace period given to `resilient run`."""
    timeout_s: float = 300.0
    """The whole faulty run must end within this."""
    hot: bool = False
    """Hot mode: snapshots every step, the DDP recipe steps through rt.micro_batches, and
    `resilient run --hot-recovery` where it exists. Only HOT_KINDS (with the FSDP2 recipe an
    exception is not rolled back in place: the failing rank is replaced warm); each fault's
    recovery (hot or cold, from the events) must be the one `expected_recovery` names."""
    numeric: dict[str, Any] = field(default_factory=dict)
    """RESILIENT_NUMERIC for the run (resilient.numeric.config.NumericConfig's fields), e.g.
    `numeric = {policy = "skip"}`, or `{spike_factor = 5.0, spike_window = 3}` for a spike
    to be seen. The fault-free run gets only the steps the faulty one skips (`skip_steps`)."""
    mesh: dict[str, int] = field(default_factory=dict)
    """train_nd.py's mesh, e.g. `mesh = {dp_replicate = 1, dp_shard = 2, tp = 2}`; nproc must
    be its size (chaos/mesh.py). A resize fault relaunches on another."""
    faults: list[Fault] = field(default_factory=list)

    def __post_init__(self) -> None:
        kinds = {f.kind for f in self.faults}
        check_mesh(self)
        if "kill_during_replication" in kinds and self.recipe != "train_fsdp.py":
            raise ValueError(f"{self.name}: only sharded state (train_fsdp.py) is replicated")
        if self.hot and kinds - HOT_KINDS - NUMERIC:
            raise ValueError(
                f"{self.name}: hot mode takes only {sorted(HOT_KINDS | NUMERIC)}, got "
                f"{sorted(kinds - HOT_KINDS - NUMERIC)}"
            )
        self._check_numeric()
        for f in self.faults:
            if f.at_step >= self.steps:
                raise ValueError(f"{self.name}: fault at step {f.at_step} >= steps {self.steps}")
            if not 0 <= f.rank < (world := max(worlds(self))):
                raise ValueError(f"{self.name}: fault rank {f.rank} not in [0, {world})")
        if len(self.faults) >= self.max_restarts:
            raise ValueError(f"{self.name}: {len(self.faults)} faults need max_restarts > that")
        if self.storage not in ("local", "s3"):
            raise ValueError(f"{self.name}: storage must be local or s3, got {self.storage!r}")
        kinds = {f.kind for f in self.faults}
        if kinds & S3_ONLY and self.storage != "s3":
            raise ValueError(f'{self.name}: {sorted(kinds & S3_ONLY)} need storage = "s3"')
        if "disk_full" in kinds and self.storage != "local":
            raise ValueError(f'{self.name}: disk_full needs storage = "local"')
        if self.hosts not in (1, 2):
            raise ValueError(f"{self.name}: hosts must be 1 or 2, got {self.hosts}")
        if (self.hosts == 2) != bool(kinds & TWO_HOSTS) or (self.hosts == 2 and kinds - TWO_HOSTS):
            raise ValueError(
                f"{self.name}: {sorted(TWO_HOSTS)} need hosts = 2, and a two-host scenario has "
                f"only those faults (got hosts = {self.hosts}, faults {sorted(kinds)})"
            )
        if self.hosts == 2 and (len(self.faults) != 1 or self.faults[0].rank < self.nproc):
            raise ValueError(f"{self.name}: one node_loss, on a rank of the second host")

    def _check_numeric(self) -> None:
        from resilient.errors import ConfigError
        from resilient.numeric.config import NumericConfig

        try:
            config = NumericConfig.from_dict(dict(self.numeric))
        except (ConfigError, TypeError) as e:
            raise ValueError(f"{self.name}: numeric: {e}") from e
        for f in self.faults:
            if f.kind in SDC and (
                self.recipe != "train_ddp.py" or self.nproc * self.hosts < 2 or not config.sdc
            ):
                raise ValueError(
                    f"{self.name}: {f.kind} corrupts one DDP replica: it needs train_ddp.py, "
                    f"two ranks or more and numeric.sdc = true"
                )
            if f.kind not in POISON:
                continue
            scale = f.spike_scale
            if scale is None and not config.nonfinite:
                raise ValueError(f"{self.name}: {f.kind} makes a NaN: numeric.nonfinite is off")
            if scale is not None:
                if config.spike_factor is None or scale <= config.spike_factor:
                    raise ValueError(
                        f"{self.name}: a spike by {scale:g} at step {f.at_step} is seen only "
                        f"with numeric.spike_factor set below it (got {config.spike_factor})"
                    )
                if f.at_step < config.spike_window:
                    raise ValueError(
                        f"{self.name}: a spike at step {f.at_step} comes before the running "
                        f"mean spans numeric.spike_window = {config.spike_window} steps"
                    )
        stop = self.stops_at()
        if stop is not None and any(f.at_step > stop for f in self.faults):
            raise ValueError(
                f"{self.name}: the run stops at the bad batch of step {stop} (numeric policy "
                f"{config.policy!r}): a fault after it would never run"
            )

    def sdc_check_step(self, f: Fault) -> int:
        """The step whose replica check must see bitflip `f` (chaos/sdc.py)."""
        from chaos.sdc import first_check

        every = int(self.numeric.get("sdc_every", 100))
        return first_check(f.at_step, self.steps, self.save_every, every)

    def sdc_last_clean_step(self, f: Fault) -> int:
        """The last replica check before bitflip `f` (0: none): saves from it on are suspect."""
        from chaos.sdc import last_check

        every = int(self.numeric.get("sdc_every", 100))
        return last_check(f.at_step, self.steps, self.save_every, every)

    @property
    def numeric_policy(self) -> str:
        """What a persistent numerical fault does: "skip" or "stop" (NumericConfig.policy)."""
        return str(self.numeric.get("policy", "stop"))

    def skip_steps(self) -> list[int]:
        """The steps whose update the run skips: numeric.skip_steps, and each bad_batch's
        step under policy "skip" (up to numeric.max_skips). The fault-free run skips them too
        (its `skip_steps`): the skip-golden."""
        listed = {int(s) for s in self.numeric.get("skip_steps", ())}
        if self.numeric_policy == "skip":
            room = int(self.numeric.get("max_skips", 10))
            bad = sorted(f.at_step for f in self.faults if f.kind == "bad_batch")
            listed |= set(bad[:room])
        return sorted(listed)

    def stops_at(self) -> int | None:
        """The step of the bad batch that ends the run with ExitCode.NUMERICAL_FAULT (policy
        "stop", or "skip" with no skip left), None when the run goes to its end."""
        bad = sorted(f.at_step for f in self.faults if f.kind == "bad_batch")
        if self.numeric_policy == "skip":
            bad = bad[int(self.numeric.get("max_skips", 10)) :]
        return bad[0] if bad else None

    @property
    def expected_exit(self) -> int:
        """The exit code the (last) launch must end with: 0, or 87 after a stop."""
        if self.stops_at() is None:
            return 0
        from resilient.exitcodes import ExitCode

        return int(ExitCode.NUMERICAL_FAULT)

    def golden_key(self) -> str:
        """Runs with equal keys must end with equal bits."""
        key = (
            f"{self.recipe}-n{self.nproc * self.hosts}-s{self.steps}-e{self.save_every}"
            f"-w{self.workers}-seed{self.seed}-c{self.corpus_chars}"
        ).replace(".py", "")
        if self.mesh:  # chaos/mesh.py: dp_replicate x dp_shard x tp
            key += f"-m{describe(self.mesh)}"
        if self.hot and not self.mesh:  # micro-batches (DDP), the split each OOM retry leaves
            key += "-micro" + "".join(f"-{s}x{k}" for s, k in self.splits())
        if self.skip_steps():  # the skip-golden: the same steps' updates skipped
            key += "-skip" + "-".join(str(s) for s in self.skip_steps())
        return key

    def splits(self) -> list[tuple[int, int]]:
        """(step, split): the fault-free run must use the same micro-batch splits to end with
        the same bits. In hot mode with the DDP recipe (it steps through rt.micro_batches) an
        OOM doubles the split from its step on: one retried in place, and one outside the
        forward and backward too, whose rank is replaced and carries the doubled split
        (guard/attempt.py) into the generation that resumes from the snapshot before its
        step (snapshots every step in hot mode: chaos/launch.py)."""
        out, split = [], 1
        for f in sorted(self.faults, key=lambda f: f.at_step):
            if self.hot and self.recipe == "train_ddp.py" and f.kind == "oom":
                split *= 2
                out.append((f.at_step, split))
        return out

    @classmethod
    def load(cls, path: str | Path) -> Scenario:
        data = tomllib.loads(Path(path).read_text())
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Scenario:
        data = dict(data)
        faults = [Fault(**f) for f in data.pop("fault", [])]
        known = {f.name for f in dataclasses.fields(cls)} - {"faults"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown scenario keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data, faults=faults)

    def to_toml(self) -> str:
        lines = []
        for f in dataclasses.fields(self):
            if f.name != "faults" and getattr(self, f.name) is not None:
                lines.append(f"{f.name} = {_toml_value(getattr(self, f.name))}")
        for fault in self.faults:
            lines += ["", "[[fault]]"]
            lines += [
                f"{k.name} = {_toml_value(getattr(fault, k.name))}"
                for k in dataclasses.fields(fault)
                if getattr(fault, k.name) is not None  # TOML has no null: the default
            ]
        return "\n".join(lines) + "\n"
