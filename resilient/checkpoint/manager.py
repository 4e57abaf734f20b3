"""CheckpointManager: sharded save/load on DCP with an atomic, verified commit and retention.

Knows nothing about signals or supervisors. All cross-rank agreement goes through the process
group it is given, which must not be the training group: async saves run their collectives
from a background thread while training runs its own (docs/internals.md#g-async-save-group).
"""

from __future__ import annotations

import builtins
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from resilient import __version__
from resilient.checkpoint._dcp_read import (
    SafeLoadPlanner,
    VerificationFailed,
    Verifier,
    make_reader,
)
from resilient.checkpoint._dcp_write import make_writer
from resilient.checkpoint.collectives import Collectives
from resilient.checkpoint.config import CheckpointConfig, CheckpointInfo
from resilient.checkpoint.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    parse_step_dir,
    step_dir,
)
from resilient.checkpoint.state import TrainState, Unpacked, pack
from resilient.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
)
from resilient.log import get_logger
from resilient.storage import Storage

__all__ = ["CheckpointConfig", "CheckpointInfo", "CheckpointManager"]

_DCP_METADATA = ".metadata"


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
        self._executor: ThreadPoolExecutor | None = None
        self._stager: DefaultStager | None = None
        self._staged: Future[Any] | None = None
        self._pending: Future[int | None] | None = None
        self._retention: Future[None] | None = None
        self._log = get_logger()
        self.last_committed: int | None = None
        # Steps that failed verification in load_latest: a later save of the same step
        # replaces them instead of being skipped as "already committed".
        self._rejected: set[int] = set()
        if config.async_save:
            self._start_threads()

    # ---------------------------------------------------------------- discovery
    def check_writable(self) -> None:
        """Create the location if needed and prove it writable (rank 0), before training starts."""
        self.collectives.agree(self.storage.check_writable)

    def list(self) -> builtins.list[CheckpointInfo]:
        """Checkpoint directories under the root, oldest first. Foreign names are ignored."""
        infos = []
        for name in self.storage.list_dirs():
            step = parse_step_dir(name)
            if step is not None:
                committed = self.storage.exists(f"{name}/{MANIFEST_NAME}")
                infos.append(CheckpointInfo(step=step, committed=committed))
        return sorted(infos, key=lambda i: i.step)

    def read_manifest(self, step: int) -> Manifest:
        where = f"{self.storage.url}/{step_dir(step)}/{MANIFEST_NAME}"
        return Manifest.from_json(
            self.storage.read_bytes(f"{step_dir(step)}/{MANIFEST_NAME}"), where=where
        )

    def verify(self, step: int, manifest: Manifest) -> builtins.list[str]:
        """This rank's share of the file checks; returns the problems found (empty when valid).

        A separate full read of the files (`resilient verify`); loading checks the files from
        the bytes it loads instead (resilient/checkpoint/_dcp_read.py)."""
        problems = []
        names = sorted(manifest.files)
        for i, name in enumerate(names):
            if i % self.world_size != self.rank:
                continue
            want = manifest.files[name]
            rel = f"{step_dir(step)}/{name}"
            algo = manifest.checksum
            try:
                value, size = self.storage.checksum(rel, algorithm=algo)
            except FileNotFoundError:
                problems.append(f"{name}: missing (expected {want.size} bytes)")
                continue
            if size != want.size:
                problems.append(f"{name}: size {size} != expected {want.size} (truncated or torn)")
            elif value != want.checksum:
                problems.append(
                    f"{name}: {algo} {value:08x} != expected {want.checksum:08x} (corrupt)"
                )
        return problems

    # ---------------------------------------------------------------- save
    def save(self, state: TrainState, step: int, *, blocking: bool | None = None) -> None:
        """Checkpoint `state` as taken after `step` steps.

        Async (the default of the config) returns once tensors are being staged; the caller
        must call `wait_staged()` before mutating parameters or optimizer state (the runtime
        does this from an optimizer pre-step hook). A previous save in flight is waited for
        first. Raises CheckpointError if a previous async save failed.

        A blocking save returns at its commit: the deletion of checkpoints beyond keep_last
        runs on the manager's thread, and `wait()`, the next save, a load and `close()` wait
        for it.
        """
        self.wait()
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
        staged = self._get_stager().stage(tensors)
        if not isinstance(staged, Future):  # synchronous stager: already a copy
            done: Future[Any] = Future()
            done.set_result(staged)
            staged = done
        self._staged = staged
        blocked = time.perf_counter() - t0
        self._pending = self._get_executor().submit(
            self._async_job, staged, blobs, list(sd), step, t0, blocked, built
        )

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
        staged = self._staged
        if staged is not None:
            staged.result()
            self._staged = None

    def wait(self) -> int | None:
        """Wait for the in-flight save and its retention; return its committed step. Raises
        the save's error, if any."""
        pending, self._pending = self._pending, None
        self.wait_staged()
        try:
            return None if pending is None else pending.result()
        finally:
            retention, self._retention = self._retention, None
            if retention is not None:
                retention.result()  # never raises: _retain_logged logs instead

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def _write_and_commit(
        self, sd: dict[str, Any], step: int, t0: float, *, staged_at: float, on_loop: bool
    ) -> int | None:
        rel = step_dir(step)
        try:
            # Every storage call of this save shares one deadline (RetryPolicy.save_budget_s).
            with self.storage.budget(self.config.retry.save_budget_s):
                if self.collectives.agree(lambda: self._prepare_dir(rel)) == "exists":
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
                manifest = self.collectives.agree(lambda: self._commit(step, entries))
        # DCP's CheckpointException is a BaseException: without it, a failed write escaped
        # unlogged and uncounted.
        except (Exception, CheckpointException) as e:
            error = self.storage.redact(_why(e))
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
            hint = self.storage.explain(_first_failure(e))
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
        )
        if self.rank == 0:
            if on_loop:  # a blocking save returns at its commit; deleting can wait
                self._retention = self._get_executor().submit(self._retain_logged, step)
            else:
                self._retain_logged(step)
        return step

    def _prepare_dir(self, rel: str) -> str:
        if parse_step_dir(rel) in self._rejected:
            self._log.warning("ckpt.save.replace_invalid", dir=rel)
            self._delete(rel)
        else:
            present = self.storage.list_sizes(rel, missing_ok=True)  # one request on S3
            if MANIFEST_NAME in present:
                return "exists"
            if present:  # a torn save of this step from an earlier attempt
                self._log.warning("ckpt.save.clear_torn", dir=rel)
                self.storage.remove_tree(rel)
        self.storage.makedirs(rel)
        return "fresh"

    def _commit(self, step: int, entries: builtins.list[dict[str, tuple[int, int]]]) -> Manifest:
        rel = step_dir(step)
        files: dict[str, FileEntry] = {}
        for per_rank in entries:
            for name, (crc, size) in per_rank.items():
                if name.endswith(".tmp"):  # DCP writes .metadata.tmp, then renames it
                    continue
                files[name] = FileEntry(size=size, checksum=crc)
        stored = self.storage.list_sizes(rel)  # one listing, not a request per file
        crc, size = self.storage.checksum(f"{rel}/{_DCP_METADATA}", size=stored.get(_DCP_METADATA))
        files[_DCP_METADATA] = FileEntry(size=size, checksum=crc)
        for name, entry in files.items():  # what storage holds is what we hashed
            found = stored.get(name)
            if found != entry.size:
                raise CheckpointError(
                    f"{rel}/{name} holds {found} bytes after the write, expected {entry.size}"
                )
        manifest = Manifest(
            step=step,
            world_size=self.world_size,
            files=files,
            torch_version=torch.__version__,
            resilient_version=__version__,
        )
        self.storage.write_bytes_atomic(f"{rel}/{MANIFEST_NAME}", manifest.to_json())
        return manifest

    def _retain_logged(self, just_committed: int) -> None:
        """_retain; a failure is logged, never raised: the checkpoint is committed, and what
        was not deleted is deleted next time."""
        try:
            self._retain(just_committed)
        except Exception as e:  # storage errors, and an unreadable listing alike
            self._log.warning(
                "ckpt.retention.failed", step=just_committed, error=self.storage.redact(str(e))
            )

    def _retain(self, just_committed: int) -> None:
        """Delete committed checkpoints beyond keep_last and torn saves older than the newest.

        The checkpoint just written is always kept: newer committed ones may exist that failed
        verification (a run resumed from an older checkpoint), and they must not push out the
        newest one known to be valid.
        """
        infos = self.list()
        committed = [i.step for i in infos if i.committed]
        if not committed:
            return
        keep = set(committed[-self.config.keep_last :]) | {just_committed}
        newest = committed[-1]
        for info in infos:
            if info.step in keep:
                continue
            if info.committed:
                reason = f"beyond keep_last={self.config.keep_last}"
            elif info.step < newest:
                reason = "unfinished save older than the newest checkpoint"
            else:
                continue  # may be a save in flight elsewhere: never touched
            self._delete(step_dir(info.step))
            self._log.info("ckpt.retention.delete", step=info.step, reason=reason)

    def _delete(self, rel: str) -> None:
        """Delete checkpoint directory `rel`, its manifest first: a deletion cut short (a
        kill, a storage error) leaves an unfinished save, which loads skip and retention
        finishes later, never a committed checkpoint with files missing."""
        self.storage.remove_file(f"{rel}/{MANIFEST_NAME}")
        self.storage.remove_tree(rel)

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
        """Committed steps, newest first, as rank 0 lists them (every rank gets the same)."""
        return self.collectives.agree(
            lambda: [i.step for i in reversed(self.list()) if i.committed]
        )

    def try_load(self, state: TrainState, step: int, *, started: float | None = None) -> bool:
        """Verify checkpoint `step` against its manifest and load it into `state`.

        False, logged as ckpt.fallback, when it fails verification or loading on any rank (all
        ranks agree). Raises CheckpointMismatchError when it does not fit the tracked state.
        `started` (a perf_counter time) is where ckpt.load's `seconds` count from.
        """
        t0 = time.perf_counter() if started is None else started
        try:
            manifest = self.collectives.agree(lambda: self.read_manifest(step))
        except CheckpointCorruptError as e:
            self._log.error("ckpt.fallback", step=step, reason=str(e))
            self._rejected.add(step)
            return False
        problems: builtins.list[str] = []
        error: str | None = None
        try:
            self._load(state, step, manifest)
        except (CheckpointMismatchError, ConfigError):
            raise
        except VerificationFailed as e:
            problems = e.problems
        except (Exception, CheckpointException) as e:
            found = _verification_problems(e)
            if found:
                problems = found
            else:
                error = self.storage.redact(f"rank {self.rank}: {_why(e)}")
        # all ranks must land on the same checkpoint, even if only one failed to load it
        outcomes = self.collectives.gather_all((problems, error))
        problems = sorted({p for ps, _ in outcomes for p in ps})
        errors = [err for _, err in outcomes if err]
        if problems:
            self._log.error(
                "ckpt.fallback", step=step, reason="verification failed", problems=problems
            )
            self._rejected.add(step)
            return False
        if errors:
            self._log.error("ckpt.fallback", step=step, reason="; ".join(errors))
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

    def _load(self, state: TrainState, step: int, manifest: Manifest) -> None:
        verifier = Verifier(
            storage=self.storage,
            rel=step_dir(step),
            manifest=manifest,
            rank=self.rank,
            world_size=self.world_size,
            gather=self.collectives.gather_all,
            buffer_bytes=self.config.verify_buffer_mib << 20,
        )
        reader = make_reader(self.storage, step_dir(step), verifier=verifier)
        # Every rank checks .metadata before unpickling it; all agree before going on.
        problems: builtins.list[str] = []
        failed: Exception | None = None
        try:
            md = reader.read_metadata()
        except VerificationFailed as e:
            problems = e.problems
        except Exception as e:  # refused by the restricted unpickler, unreadable, ...
            failed = e
        mine = None if failed is None else self.storage.redact(f"rank {self.rank}: {_why(failed)}")
        outcomes = self.collectives.gather_all((problems, mine))
        problems = sorted({p for ps, _ in outcomes for p in ps})
        if problems:
            raise VerificationFailed(problems)
        if failed is not None:
            raise failed
        others = [err for _, err in outcomes if err]
        if others:
            raise CheckpointError("; ".join(others))
        saved = md.state_dict_metadata
        self._check_fits(state, saved, step)
        same_world = manifest.world_size == self.world_size
        if not same_world:
            self._log.warning(
                "ckpt.load.reshard",
                step=step,
                saved_world_size=manifest.world_size,
                world_size=self.world_size,
                note="per-rank state (RNG, dataloader position) is not restored",
            )
        template = state.load_template(
            rank=self.rank, has_rank_blob=same_world and f"rank{self.rank}" in saved
        )
        try:
            dcp.load(
                template,
                storage_reader=reader,
                planner=SafeLoadPlanner(),
                process_group=self._pg,
                no_dist=not self._distributed,
            )
        finally:
            verifier.drop_ahead()  # a load that failed before its check
        state.apply(template, rank=self.rank)

    def _check_fits(self, state: TrainState, saved: dict[str, Any], step: int) -> None:
        if state.model is None:
            return
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        want = {
            k: tuple(v.shape)
            for k, v in get_model_state_dict(state.model).items()
            if isinstance(v, torch.Tensor)
        }
        have = {
            k[len("model.") :]: tuple(getattr(v, "size", ()))
            for k, v in saved.items()
            if k.startswith("model.")
        }
        missing = sorted(set(want) - set(have))
        unexpected = sorted(set(have) - set(want))
        shapes = sorted(
            f"{k}: checkpoint {have[k]} vs model {want[k]}"
            for k in set(want) & set(have)
            if have[k] != want[k]
        )
        if missing or unexpected or shapes:
            raise CheckpointMismatchError(
                f"checkpoint {self.storage.url}/{step_dir(step)} does not match the tracked model: "
                f"missing keys {missing[:10]}{'...' if len(missing) > 10 else ''}, "
                f"unexpected keys {unexpected[:10]}{'...' if len(unexpected) > 10 else ''}"
                + (f", shape mismatches {shapes[:10]}" if shapes else "")
                + ". Point the checkpoint location at this model's checkpoints, or use a new one."
            )

    # ---------------------------------------------------------------- lifecycle
    def _get_executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resilient-ckpt")
        return self._executor

    def _start_threads(self) -> None:
        """Start the save's and the stager's threads now: started by the first save, each
        took the GIL from the loop for up to a switch interval (5 ms) while starting."""
        self._get_executor().submit(lambda: None).result()
        started = self._get_stager().stage({})
        if isinstance(started, Future):
            started.result()

    def _get_stager(self) -> DefaultStager:
        if self._stager is None:
            # Background staging works on CPU and GPU; pinned memory and non-blocking copies
            # need an accelerator, so they are on only where CUDA is.
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=cuda,
                )
            )
        return self._stager

    def close(self) -> None:
        """Wait for the in-flight save and release threads and staging buffers."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None


def _first_failure(e: BaseException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException, else `e` itself."""
    failures = getattr(e, "failures", None)
    if isinstance(e, CheckpointException) and isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        exc = first[0] if isinstance(first, tuple) else first
        if isinstance(exc, BaseException):
            return exc
    return e


def _verification_problems(e: BaseException) -> builtins.list[str]:
    """The problems of a VerificationFailed raised inside dcp.load (in its CheckpointException)."""
    failures = getattr(e, "failures", None)
    found: builtins.list[str] = []
    if isinstance(e, CheckpointException) and isinstance(failures, dict):
        for failure in failures.values():
            exc = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(exc, VerificationFailed):
                found += exc.problems
    return found


def _why(e: BaseException) -> str:
    """One line per failing rank for DCP's CheckpointException (its str is full tracebacks)."""
    failures = getattr(e, "failures", None)
    if isinstance(e, CheckpointException) and isinstance(failures, dict) and failures:
        parts = []
        for rank, failure in sorted(failures.items()):
            exc = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        return "; ".join(parts)
    return f"{type(e).__name__}: {e}"
