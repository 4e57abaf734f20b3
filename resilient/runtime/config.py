"""`RuntimeConfig`: how the runtime saves and logs, and `resilient.init()`'s options.

`init(checkpoint_dir, **options)` takes fields of RuntimeConfig and of CheckpointConfig in one
flat set of keywords; `build_config` sorts them, checks them and applies the environment the
launcher (or `resilient check-resume`) set.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from resilient.checkpoint import CheckpointConfig
from resilient.data.policy import BATCH_POLICIES, DEFAULT_POLICY
from resilient.envvars import ENV_BATCH_POLICY, ENV_CHECKPOINT_DIR, ENV_SCRATCH
from resilient.errors import ConfigError
from resilient.hang.config import WatchdogConfig
from resilient.memory.snapshot import SnapshotConfig
from resilient.numeric.config import NumericConfig
from resilient.preempt.watch import PreemptConfig

__all__ = ["RuntimeConfig", "build_config"]


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    """How the runtime saves and logs. Checkpoint storage details live in `checkpoint`."""

    checkpoint: CheckpointConfig
    """Where checkpoints go and how they are written."""
    run_dir: str | None = None
    """Per-rank JSON event logs go to <run_dir>/logs. Default: $RESILIENT_RUN_DIR, else
    ./runs/<run id>."""
    save_every_steps: int | None = 100
    """Save after every N completed steps; None to save on time only."""
    save_every_seconds: float | None = None
    """Save when this many seconds passed since the last save (decided by rank 0 for all)."""
    save_at_end: bool = True
    """Save (synchronously) when `steps()` reaches `total`."""
    backend: str | None = None
    """Training process-group backend; default gloo on CPU, cpu:gloo,cuda:nccl on GPU."""
    pg_timeout_s: float = 1800.0
    """Collective timeout of the training group."""
    side_timeout_s: float = 300.0
    """Collective timeout of the control and checkpoint groups."""
    console_level: str = "INFO"
    """Lowest level shown on the console; the JSON log keeps everything."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig.from_env)
    """Hang detection, heartbeats, barrier and OOM-guard settings; init() also takes a dict
    of its fields. Default: WatchdogConfig defaults with $RESILIENT_WATCHDOG overrides."""
    preempt: PreemptConfig = field(default_factory=PreemptConfig.from_env)
    """Preemption signals, grace period and check interval (resilient.preempt.watch); init()
    also takes a dict. Default: $RESILIENT_GRACE_S and $RESILIENT_PREEMPT_SIGNALS, which
    `resilient run` sets, else 30 s and SIGTERM,SIGUSR1."""
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig.from_env)
    """In-memory snapshots and in-place rollback on an agreed exception (off by default;
    resilient.memory.snapshot); init() also takes a dict. Default: $RESILIENT_SNAPSHOT."""
    numeric: NumericConfig = field(default_factory=NumericConfig.from_env)
    """Numerical faults: non-finite losses and gradients (checked by default), loss spikes,
    and what a persistent one does (resilient.numeric); init() also takes a dict."""
    pin_ddp_buckets: bool = True
    """Fix a tracked DDP model's gradient buckets at track(), in parameter order, so every
    process, fresh or resumed, all-reduces with the same layout from its first step. Without
    it DDP reduces a process's first step in one bucket and later ones in buckets rebuilt in
    gradient-ready order, so on 3 or more ranks the step after a resume sums in another order
    and the run is no longer bit-exact. False keeps DDP's own layout: more communication
    overlaps the backward pass on large models (resilient.groups.ddp)."""
    batch_policy: str = field(
        default_factory=lambda: os.environ.get(ENV_BATCH_POLICY) or DEFAULT_POLICY
    )
    """When the loader's batch size cannot split the global batch on a new data-parallel
    degree (a node lost from three): "exact" keeps the global batch in micro-batches of
    another size (sample-exact, not bitwise), "follow" keeps the per-rank batch and lets the
    global batch follow the world (docs/operating.md#elastic-world-size). Default:
    $RESILIENT_BATCH_POLICY (`resilient run --batch-policy`), else "exact"."""
    init_from: str | None = None
    """Initial weights for a run that has no checkpoint of its own yet: a resilient checkpoint
    location (of another run; a `step_*` directory, or `init_step`, picks the step), a Hugging
    Face safetensors directory, or a torch.save file. Resharded onto this world size and
    layout, verified where the source has checksums. Once the run has committed a checkpoint,
    resumes load that and never this again (resilient/weights/load.py)."""
    init_step: int | None = None
    """The step of a resilient `init_from` (default: its newest committed checkpoint)."""
    init_exclude: tuple[str, ...] = ()
    """Glob patterns of model keys `init_from` leaves at their initialization (a new head)."""
    init_with: tuple[str, ...] = ("model",)
    """What `init_from` takes: "model" alone by default; from a resilient checkpoint also
    "optimizer", "scheduler", "data" (the loader's position) and "rng". The step count
    starts at 0 whatever is taken: it is a new run."""

    def __post_init__(self) -> None:
        if self.batch_policy not in BATCH_POLICIES:
            raise ConfigError(
                f"batch_policy must be one of {', '.join(BATCH_POLICIES)}, got "
                f"{self.batch_policy!r}"
            )
        self.init_exclude = tuple(self.init_exclude)
        self.init_with = tuple(self.init_with)
        bad = set(self.init_with) - set(INIT_PARTS)
        if bad or "model" not in self.init_with:
            raise ConfigError(
                f"init_with must hold 'model' and any of {list(INIT_PARTS[1:])}, got "
                f"{list(self.init_with)}"
            )
        if self.init_from is None and (
            self.init_step is not None or self.init_exclude or self.init_with != ("model",)
        ):
            raise ConfigError("init_step, init_exclude and init_with need init_from=SOURCE")
        if self.init_with != ("model",) and self.init_exclude:
            raise ConfigError(
                "init_exclude works with init_with=('model',) only: optimizer state is kept "
                "per parameter, so a partly loaded model cannot take the source's optimizer"
            )
        if (
            self.numeric.policy == "skip"
            and not self.snapshot.enabled
            and self.save_every_steps is None
            and self.save_every_seconds is None
        ):
            raise ConfigError(
                "numeric policy 'skip' replays the faulty step first, from a snapshot or a "
                "checkpoint: turn snapshots on (snapshot={'enabled': True}) or save on a "
                "schedule (save_every_steps or save_every_seconds)"
            )
        if self.save_every_steps is not None and self.save_every_steps < 1:
            raise ConfigError(f"save_every_steps must be >= 1 or None, got {self.save_every_steps}")
        if self.save_every_seconds is not None and self.save_every_seconds <= 0:
            raise ConfigError(
                f"save_every_seconds must be > 0 or None, got {self.save_every_seconds}"
            )
        if self.side_timeout_s <= 0 or self.pg_timeout_s <= 0:
            raise ConfigError("pg_timeout_s and side_timeout_s must be > 0 seconds")
        if self.console_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ConfigError(
                f"console_level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, "
                f"got {self.console_level!r}"
            )


INIT_PARTS = ("model", "optimizer", "scheduler", "data", "rng")
"""What init_with may name (RuntimeConfig.init_with)."""

_RUNTIME_FIELDS = {f.name for f in dataclasses.fields(RuntimeConfig)} - {"checkpoint"}
_CKPT_FIELDS = {f.name for f in dataclasses.fields(CheckpointConfig)} - {"url"}


def build_config(
    checkpoint_dir: str | os.PathLike[str] | None, options: dict[str, Any]
) -> RuntimeConfig:
    """The RuntimeConfig of `init(checkpoint_dir, **options)`; ConfigError on an unknown
    option or a value out of range."""
    options = dict(options)
    unknown = set(options) - _RUNTIME_FIELDS - _CKPT_FIELDS
    if unknown:
        raise ConfigError(
            f"unknown option(s) {sorted(unknown)}; valid options are "
            f"{sorted(_RUNTIME_FIELDS | _CKPT_FIELDS)}"
        )
    url = (
        os.fspath(checkpoint_dir)
        if checkpoint_dir is not None
        else (os.environ.get(ENV_CHECKPOINT_DIR) or "checkpoints")
    )
    scratch = os.environ.get(ENV_SCRATCH)
    if scratch:  # resilient check-resume: never the script's own locations
        url, options["run_dir"] = os.path.join(scratch, "ckpt"), os.path.join(scratch, "run")
        options.pop("local_url", None)
    ckpt = CheckpointConfig(url=url, **{k: v for k, v in options.items() if k in _CKPT_FIELDS})
    if isinstance(options.get("watchdog"), dict):
        options["watchdog"] = WatchdogConfig.from_env(options["watchdog"])
    if isinstance(options.get("preempt"), dict):
        options["preempt"] = PreemptConfig.from_env(options["preempt"])
    if isinstance(options.get("numeric"), dict):
        options["numeric"] = NumericConfig.from_env(options["numeric"])
    if isinstance(options.get("snapshot"), dict):
        options["snapshot"] = SnapshotConfig.from_env(options["snapshot"])
    return RuntimeConfig(
        checkpoint=ckpt, **{k: v for k, v in options.items() if k in _RUNTIME_FIELDS}
    )
