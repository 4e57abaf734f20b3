"""CheckpointManager: sharded save/load on DCP with an atomic, verified commit and retention.

Knows nothing about signals or supervisors. All cross-rank agreement goes through the process
group it is given, which must not be the training group: async saves run their collectives
from a background thread while training runs its own (docs/internals.md#g-async-save-group).

The manager runs each save from capture to commit and picks the checkpoint to load; its parts
are modules beside it: the save thread and stager (pipeline.py), the two ends of the commit
(commit.py), the check for non-finite values before anything is written (finite.py), the
record of numerical faults (faults.py), loading one checkpoint (loading.py), and listing and
deleting checkpoints (retention.py).
"""

from __future__ import annotations

import builtins
import functools
import time
import warnings
from concurrent.futures import Future
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from resilient.checkpoint._dcp_errors import first_failure, why
from resilient.checkpoint._dcp_write import make_writer
from resilient.checkpoint.collectives import Collectives
from resilient.checkpoint.commit import prepare_dir, write_manifest
from resilient.checkpoint.config import CheckpointConfig, CheckpointInfo
from resilient.checkpoint.faults import SUSPECT, note_fault, read_faults, without_suspect
from resilient.checkpoint.finite import check_agreed
from resilient.checkpoint.loading import Loader
from resilient.checkpoint.manifest import Manifest, read_manifest, step_dir
from resilient.checkpoint.pipeline import SavePipeline
from resilient.checkpoint.retention import list_checkpoints, retain_logged
from resilient.checkpoint.state import TrainState, Unpacked, pack
from resilient.errors import CheckpointError, ConfigError
from resilient.log import get_logger
from resilient.storage import Storage

__all__ = ["CheckpointConfig", "CheckpointInfo", "CheckpointManager"]


class CheckpointManager:
    """Saves and loads a TrainState under `config.url`.

    Every rank of `process_group` must make the same calls in the same order.
    """

    def __init__(self, config: CheckpointConfig, *, process_group: Any = None) -> None:
        if config.local_url is not None:
            raise ConfigError(
                "CheckpointConfig.local_url needs two tiers: use "
                "resilient.checkpoint.open_manager(config) or TieredCheckpointManager"
            )
        self.config = config
        self.storage = Storage(
            config.url, storage_options=config.storage_options, retry=config.retry
        )
        self.collectives = Collectives(process_group)
        """Agreement over this manager's process group (TieredCheckpointManager's too)."""
        self._distributed = self.collectives.distributed
        self._pg = process_group
        if not self._distributed:  # DCP warns on every single-process save; we mean it
            warnings.filterwarnings(
                "ignore", message="torch.distributed is disabled", category=UserWarning
            )
        self.rank = self.collectives.rank
        self.world_size = self.collectives.world_size
        self._saves = SavePipeline()
        self._log = get_logger()
        self._loader = Loader(self.storage, self.collectives, config, self._log)
        self.last_committed: int | None = None
        self._rejected: set[int] = set()  # failed verification: a later save replaces them
        self._kept_good: set[int] = set()  # steps retention said it keeps before a fault
        if config.async_save:
            self._saves.start_threads()

    # ---------------------------------------------------------------- discovery
    def check_writable(self) -> None:
        """Create the location if needed and prove it writable (rank 0), before training starts."""
        self.collectives.agree(self.storage.check_writable)

    def list(self) -> builtins.list[CheckpointInfo]:
        """Checkpoint directories under the root, oldest first. Foreign names are ignored."""
        return list_checkpoints(self.storage)

    def read_manifest(self, step: int) -> Manifest:
        return read_manifest(self.storage, step)

    def verify(self, step: int, manifest: Manifest) -> builtins.list[str]:
        """This rank's share of the file checks; returns the problems found (empty when valid).

        A separate full read of the files (`resilient verify`); loading checks the files from
        the bytes it loads instead (resilient/checkpoint/_dcp_read.py)."""
        return self._loader.verify(step, manifest)

    # ---------------------------------------------------------------- save
    def save(self, state: TrainState, step: int, *, blocking: bool | None = None) -> None:
        """Checkpoint `state` as taken after `step` steps.

        Async (the default of the config) returns once tensors are being staged; until the
        copy is done, `optimizer.step()` and the model's forward wait for it (pipeline.py).
        A previous save in flight is waited for first. Raises CheckpointError if a previous
        async save failed.

        The model and optimizer state is checked finite first, agreed by all ranks: a NaN or
        an infinity raises NumericalFaultError on every rank with nothing written, never
        retried nor "continue"d (resilient/checkpoint/finite.py; async: on the save thread).

        A blocking save returns at its commit: the deletion of checkpoints beyond keep_last
        runs on the manager's thread, and `wait()`, the next save, a load and `close()` wait
        for it.
        """
        self.wait()
        self._of = (state.layout, state.unchecked())  # this save's (Manifest.layout, same-name)
        blocking = not self.config.async_save if blocking is None else blocking
        t0 = time.perf_counter()
        self._log.info("ckpt.save.start", step=step, mode="sync" if blocking else "async")
        if blocking:
            sd = state.to_state_dict(step=step, rank=self.rank)
            self._write_and_commit(sd, step, t0, staged_at=t0, on_loop=True)
            return
        # The blobs (step, scheduler, RNG, data position) are captured here and torch.save'd
        # on the save's thread: only the tensors go through the stager.
        sd = state.capture(step=step, rank=self.rank)
        built = time.perf_counter() - t0
        blobs = {k: v for k, v in sd.items() if isinstance(v, Unpacked)}
        tensors = {k: v for k, v in sd.items() if k not in blobs}
        staged = self._saves.stage(tensors, fence=(state.model, state.optimizer))
        blocked = time.perf_counter() - t0
        self._saves.submit(self._async_job, staged, blobs, list(sd), step, t0, blocked, built)

    def _async_job(
        self,
        staged: Future[Any],
        blobs: dict[str, Unpacked],
        order: builtins.list[str],
        step: int,
        t0: float,
        blocked: float,
        built: float,
    ) -> int | None:
        packed = pack(blobs)  # while the stager copies the tensors
        copies = staged.result()
        sd = {k: packed[k] if k in packed else copies[k] for k in order}
        staged_at = time.perf_counter()
        self._log.info(
            "ckpt.save.staged",
            step=step,
            blocked_s=round(blocked, 4),
            state_dict_s=round(built, 4),
            staging_s=round(staged_at - t0, 4),
        )
        return self._write_and_commit(sd, step, t0, staged_at=staged_at, on_loop=False)

    def wait_staged(self) -> None:
        """Block until the in-flight async save no longer reads live tensors."""
        self._saves.wait_staged()

    def wait(self) -> int | None:
        """Wait for the save in flight and its retention; its committed step, or its error."""
        return self._saves.wait()

    def settle(self) -> None:
        """Wait for the save in flight and its retention, leaving its error to `wait()`."""
        self._saves.settle()

    @property
    def in_flight(self) -> bool:
        return self._saves.in_flight

    def note_numerical_fault(self, step: int, **details: Any) -> int:
        """Record a numerical fault at `step` (and `details`) in numerical_faults.json
        (faults.py); return the first fault step recorded there. A collective, after the save
        in flight has ended; an unreadable record raises CheckpointError naming the file."""
        self.settle()
        return note_fault(self.storage, self.collectives, step, details, self._log)

    def numerical_faults(self) -> builtins.list[int]:
        """The steps of the faults recorded in this location (rank 0 reads; a collective)."""
        return self.collectives.agree(lambda: [int(f["step"]) for f in read_faults(self.storage)])

    def _write_and_commit(
        self, sd: dict[str, Any], step: int, t0: float, *, staged_at: float, on_loop: bool
    ) -> int | None:
        rel = step_dir(step)
        # Before anything is written, and outside the handling of storage failures below: a
        # non-finite state is never a failed save to retry or to train past.
        layout, skip = self._of
        check_s = check_agreed(sd, step, self.collectives, self._log, self.last_committed, skip)
        try:
            # Every storage call of this save shares one deadline (RetryPolicy.save_budget_s).
            with self.storage.budget(self.config.retry.save_budget_s):
                prepared = self.collectives.agree(
                    lambda: prepare_dir(self.storage, rel, rejected=self._rejected, log=self._log)
                )
                if prepared == "exists":
                    self._log.info("ckpt.save.skipped", step=step, reason="already committed")
                    return step
                writer = make_writer(
                    self.storage,
                    rel,
                    thread_count=self.config.write_threads,
                    drop_behind=not self.config.keep_in_page_cache,
                )
                dcp.save(
                    sd,
                    storage_writer=writer,
                    planner=DefaultSavePlanner(),
                    process_group=self._pg,
                    no_dist=not self._distributed,
                )
                written = time.perf_counter()
                entries = self.collectives.gather_all(writer.file_checksums)
                manifest = self.collectives.agree(
                    lambda: write_manifest(
                        self.storage, step, self.world_size, entries, finite=True, layout=layout
                    )
                )
        # DCP's CheckpointException is a BaseException: without it, a failed write escaped
        # unlogged and uncounted.
        except (Exception, CheckpointException) as e:
            error = self.storage.redact(why(e))
            self._log.error(
                "ckpt.save.failed",
                step=step,
                error=error,
                newest_valid=self.last_committed,
                action=self.config.on_save_error,
            )
            if self.config.on_save_error == "continue":
                return None
            if isinstance(e, CheckpointError):
                raise
            hint = self.storage.explain(first_failure(e))
            raise CheckpointError(
                self.storage.redact(f"saving step {step} to {self.storage.url} failed: {error}")
                + (f". {hint}" if hint else "")
            ) from e
        done = time.perf_counter()
        self.last_committed = step
        self._log.info(
            "ckpt.save.committed",
            step=step,
            bytes=manifest.total_bytes,
            files=len(manifest.files),
            seconds=round(done - t0, 4),
            write_s=round(written - staged_at, 4),
            commit_s=round(done - written, 4),
            finite_check_s=round(check_s, 4),
        )
        if self.rank == 0:
            retain = functools.partial(
                retain_logged,
                self.storage,
                self.config.keep_last,
                step,
                self._log,
                said=self._kept_good,
            )
            if on_loop:  # a blocking save returns at its commit; deleting can wait
                self._saves.submit_retention(retain)
            else:
                retain()
        return step

    # ---------------------------------------------------------------- load
    def load_latest(self, state: TrainState) -> int | None:
        """Load the newest checkpoint that verifies into `state`; return its step.

        Falls back to older checkpoints when one fails verification (logged with the file and
        what was expected). Returns None, after logging a fresh start, when there is none.
        Raises CheckpointMismatchError when a valid checkpoint does not fit the tracked state.
        """
        self.wait()
        t0 = time.perf_counter()
        candidates = self.candidates()
        fresh = state.optimizer_is_fresh()
        for step in candidates:
            if self.try_load(state, step, started=t0):
                return step
        if fresh:
            state.forget_failed_loads()
        self._log.info(
            "ckpt.fresh_start",
            url=self.storage.url,
            reason="no valid checkpoint" if candidates else "no checkpoint",
        )
        return None

    def candidates(self) -> builtins.list[int]:
        """Committed steps, newest first, as rank 0 lists them (every rank the same), less the
        suspect ones (faults.without_suspect), which a later save of their step replaces."""
        committed = lambda: [i.step for i in reversed(self.list()) if i.committed]  # noqa: E731
        steps, suspect = self.collectives.agree(
            lambda: without_suspect(self.storage, committed(), self.read_manifest)
        )
        if suspect:
            self._rejected.update(suspect)
            self._log.warning("ckpt.suspect_skipped", steps=suspect, reason=SUSPECT)
        return steps

    def try_load(self, state: TrainState, step: int, *, started: float | None = None) -> bool:
        """Verify checkpoint `step` against its manifest and load it into `state`.

        False, logged as ckpt.fallback, when it fails verification or loading on any rank (all
        ranks agree). Raises CheckpointMismatchError when it does not fit the tracked state.
        `started` (a perf_counter time) is where ckpt.load's `seconds` count from.
        """
        t0 = time.perf_counter() if started is None else started
        manifest = self._loader.try_load(state, step)
        if manifest is None:
            self._rejected.add(step)
            return False
        self.last_committed = step
        self._log.info(
            "ckpt.load",
            step=step,
            bytes=manifest.total_bytes,
            saved_world_size=manifest.world_size,
            url=self.storage.url,
            seconds=round(time.perf_counter() - t0, 4),
        )
        return True

    def load_weights(
        self, model: Any, step: int | None = None, *, strict: bool = True, exclude: Any = None
    ) -> tuple[int, builtins.list[str]]:
        """Load the model's weights alone from checkpoint `step` (default: the newest
        committed), verified; return the step and the keys loaded. No fallback to an older
        checkpoint: a source named for its weights must be the one loaded (Loader.load_weights)."""
        t0 = time.perf_counter()
        step = _chosen_step(self.candidates(), step, self.storage.url)
        names = self._loader.load_weights(model, step, strict=strict, exclude=exclude)
        self._log.info("ckpt.load.weights", step=step, url=self.storage.url, keys=len(names),
                       seconds=round(time.perf_counter() - t0, 4))  # fmt: skip
        return step, names

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Wait for the in-flight save and release threads and staging buffers."""
        self._saves.close()


def _chosen_step(committed: builtins.list[int], step: int | None, where: str) -> int:
    """`step`, or the newest of `committed` when None; CheckpointError naming what there is."""
    if not committed:
        raise CheckpointError(
            f"no committed checkpoint under {where}: point at the directory a run saved to "
            "(it holds step_*/manifest.json)"
        )
    if step is None:
        return committed[0]
    if step not in committed:
        raise CheckpointError(
            f"no committed checkpoint at step {step} under {where}: it has steps "
            f"{sorted(committed)}"
        )
    return step
