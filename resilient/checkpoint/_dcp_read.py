"""The DCP reader of our checkpoints: restricted (no code runs) and verified in one pass.

- Restricted: stock DCP 2.13 reads `.metadata` with `pickle.load` and non-tensor values with
  `torch.load(weights_only=False)`; both run code from the checkpoint. We restrict both to
  plain data (a restricted unpickler, `SafeLoadPlanner`), so loading an untrusted checkpoint
  cannot execute code.
- Verified in one pass: before DCP touches a tensor, every file of the checkpoint is checked
  against the manifest (size and checksum) by one rank, which keeps the bytes it checked and
  serves DCP's reads of that file from them: each verified byte is read once. A file goes to
  the rank that reads most of it (same world size: each rank its own files), files no rank
  reads are shared out; ranks agree on the outcome (one all-gather) before any rank copies a
  byte into a tensor, so a checkpoint that fails anywhere leaves every rank's state
  untouched. `.metadata` is checked by every rank before it is unpickled. Past
  `buffer_bytes` per rank the files are checked in a streaming pass and DCP reads them again.
- Copied once: a tensor whose verified bytes this rank keeps is copied from them straight
  into its destination (`tensor_in_record`), not through torch.load's fresh tensor first.
- Checked ahead: the moment DCP has this rank's local plan, a thread starts checking the
  files this rank wrote and reads (its likely share on the same world size), so that the
  disk read overlaps DCP's exchange of plans; the share is still agreed before any result
  counts, and results for files outside it are dropped.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from resilient.checkpoint._dcp_fs import StorageFileSystem, VerifiedBytesFileSystem
from resilient.checkpoint._torch_archive import tensor_in_record
from resilient.checkpoint._torch_compat import metadata_path, planner_store, read_span
from resilient.checkpoint.manifest import FileEntry, Manifest
from resilient.errors import CheckpointCorruptError, CheckpointError
from resilient.storage import Buffer, Storage
from resilient.storage.checksum import updater

__all__ = [
    "SafeLoadPlanner",
    "VerificationFailed",
    "Verifier",
    "make_reader",
    "read_metadata_safely",
]

METADATA = ".metadata"
_WRITER = re.compile(r"__(\d+)_")
"""DCP's FileSystemWriter names each rank's files `__<rank>_<n>.distcp`."""


class VerificationFailed(CheckpointCorruptError):
    """Files of a checkpoint do not match its manifest; `problems` says which and how (the
    same list on every rank)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


# Globals a DCP .metadata pickle may name; anything else is refused.
_ALLOWED_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
)
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Protocol 4 resolves a dotted name attribute by attribute, so "os.system" inside an
        # allowed module would reach os.system: only plain names of classes defined there pass.
        if module in _ALLOWED_MODULES and "." not in name:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        elif (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name in {
            "strided",
            "sparse_coo",
            "contiguous_format",
            "preserve_format",
            "channels_last",
        }:
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata names a forbidden global {module}.{name}"
        )


def read_metadata_safely(stream: io.BufferedIOBase | Any) -> Metadata:
    md = _RestrictedUnpickler(stream).load()
    if not isinstance(md, Metadata):
        raise pickle.UnpicklingError(f"checkpoint metadata is a {type(md).__name__}, not Metadata")
    return md


@dataclass(kw_only=True, slots=True)
class Verifier:
    """What a reader needs to check a checkpoint against its manifest, and to agree on it."""

    storage: Storage
    rel: str
    """The checkpoint directory, relative to the storage root."""
    manifest: Manifest
    rank: int
    world_size: int
    gather: Callable[[Any], list[Any]]
    """All-gather of a picklable object over the load's process group (every rank calls)."""
    buffer_bytes: int
    """Most bytes this rank keeps in memory to serve DCP's reads from verified bytes."""
    _ahead: _CheckAhead | None = field(default=None, init=False)

    def problem(self, name: str, want: FileEntry, size: int | None, value: int | None) -> str:
        if size is None:
            return f"{name}: missing (expected {want.size} bytes)"
        if size != want.size:
            return f"{name}: size {size} != expected {want.size} (truncated or torn)"
        algo = self.manifest.checksum
        return f"{name}: {algo} {value:08x} != expected {want.checksum:08x} (corrupt)"

    def check_bytes(self, name: str, data: bytes | bytearray) -> str | None:
        """The problem with `data` as the content of file `name`, None when it matches."""
        want = self.manifest.files.get(name)
        if want is None:
            return f"{name}: not listed in the manifest"
        value = updater(self.manifest.checksum)(data, 0)
        if len(data) != want.size or value != want.checksum:
            return self.problem(name, want, len(data), value)
        return None

    def verify_for(self, reader: FileSystemReader, plan: LoadPlan) -> dict[str, Buffer]:
        """Check every file (this rank: its share); return the bytes it keeps for DCP.

        A collective: two all-gathers, which every rank reaches whatever happens on the way.
        Raises VerificationFailed (problems found) or CheckpointError (a rank could not read)
        on every rank alike.
        """
        ahead, self._ahead = self._ahead, None
        needs: dict[str, int] = {}
        error: str | None = None
        try:
            needs = _needs(reader, plan)
        except Exception as e:  # reported after the agreement, never skipping a collective
            error = f"rank {self.rank}: cannot map DCP's reads to files: {type(e).__name__}: {e}"
        everyone: list[dict[str, int]] = self.gather(needs)
        kept: dict[str, Buffer] = {}
        problems: list[str] = []
        try:
            if error is not None:
                raise CheckpointError(error)
            mine = self._share(everyone)
            keep = sum(self.manifest.files[n].size for n in mine) <= self.buffer_bytes
            checked = ahead.results() if ahead is not None else {}
            for name in mine:
                if name in checked:
                    data, problem = _outcome(checked[name])
                    data = data if keep else None
                else:
                    data, problem = self._check_file(name, keep=keep)
                if problem is not None:
                    problems.append(problem)
                elif data is not None:
                    kept[name] = data
            problems += [
                f"{name}: read by DCP but not listed in the manifest"
                for name in needs
                if name not in self.manifest.files
            ]
        except Exception as e:  # reported on every rank below, never left half-agreed
            error = self.storage.redact(f"rank {self.rank}: {type(e).__name__}: {e}")
        outcomes: list[tuple[list[str], str | None]] = self.gather((problems, error))
        found = sorted({p for ps, _ in outcomes for p in ps})
        if found:
            raise VerificationFailed(found)
        errors = [err for _, err in outcomes if err]
        if errors:
            raise CheckpointError("could not verify the checkpoint: " + "; ".join(errors))
        return kept

    def check_ahead(self, reader: FileSystemReader, plan: LoadPlan) -> None:
        """Start checking this rank's likely share in a thread (see the module doc): on the
        same world size, the files it wrote that it reads. Never raises: without a guess the
        check runs in verify_for as before."""
        if self._ahead is not None or self.manifest.world_size != self.world_size:
            return
        try:
            needs = _needs(reader, plan)
        except Exception:
            return
        names = sorted(n for n in needs if n in self.manifest.files and _writer(n) == self.rank)
        if names:
            keep = sum(self.manifest.files[n].size for n in names) <= self.buffer_bytes
            self._ahead = _CheckAhead(self, names, keep=keep)

    def drop_ahead(self) -> None:
        """A load that ends before verify_for: the thread stops after its current file."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.cancel()

    def _share(self, everyone: list[dict[str, int]]) -> list[str]:
        """The files this rank checks: those it reads most of (its own on a tie, as a
        replicated DDP state has every rank read every file), and its turn of the rest."""
        mine = []
        names = sorted(n for n in self.manifest.files if n != METADATA)
        for i, name in enumerate(names):
            reads = [needs.get(name, 0) for needs in everyone]
            writer = _writer(name)
            owner = max(range(len(reads)), key=lambda r: (reads[r], r == writer, -r))
            if reads[owner] == 0:
                owner = i % len(reads)
            if owner == self.rank:
                mine.append(name)
        return mine

    def _check_file(self, name: str, *, keep: bool) -> tuple[Buffer | None, str | None]:
        want = self.manifest.files[name]
        rel = f"{self.rel}/{name}"
        try:
            size = self.storage.size(rel)
        except FileNotFoundError:
            return None, self.problem(name, want, None, None)
        if size != want.size:
            return None, self.problem(name, want, size, None)
        if keep:
            data, value = self.storage.fetch(rel, size=size, algorithm=self.manifest.checksum)
        else:
            data = None
            value, size = self.storage.checksum(rel, size=size, algorithm=self.manifest.checksum)
        if size != want.size or value != want.checksum:
            return None, self.problem(name, want, size, value)
        return data, None


def _needs(reader: FileSystemReader, plan: LoadPlan) -> dict[str, int]:
    """file -> bytes of it that `plan` reads."""
    needs: dict[str, int] = {}
    for item in plan.items:
        span = read_span(reader, item.storage_index)
        needs[span.file] = needs.get(span.file, 0) + span.length
    return needs


def _writer(name: str) -> int | None:
    m = _WRITER.match(name)
    return int(m.group(1)) if m else None


_Checked = tuple[Buffer | None, str | None] | BaseException


def _outcome(checked: _Checked) -> tuple[Buffer | None, str | None]:
    if isinstance(checked, BaseException):
        raise checked  # as if the check had run here
    return checked


class _CheckAhead:
    """Verifier._check_file over `names`, in a thread of its own."""

    def __init__(self, verifier: Verifier, names: list[str], *, keep: bool) -> None:
        self._checked: dict[str, _Checked] = {}
        self._cancelled = False
        self._thread = threading.Thread(
            target=self._run, args=(verifier, names, keep), name="resilient-check", daemon=True
        )
        self._thread.start()

    def _run(self, verifier: Verifier, names: list[str], keep: bool) -> None:
        for name in names:
            if self._cancelled:
                return
            try:
                self._checked[name] = verifier._check_file(name, keep=keep)
            except BaseException as e:  # raised again where the result is used
                self._checked[name] = e

    def results(self) -> dict[str, _Checked]:
        self._thread.join()
        return self._checked

    def cancel(self) -> None:
        self._cancelled = True


class _SafeReader(FileSystemReader):
    """Reads `.metadata` with a restricted unpickler and, with a Verifier, checks every file
    against the manifest before DCP reads it, from the same bytes."""

    verifier: Verifier | None = None
    fs: Any

    def __init__(self, path: Any) -> None:
        super().__init__(path)
        self._metadata_bytes: dict[str, bytes] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = metadata_path(self, kwargs.get("rank"))
        # The manager reads it (to check the model fits) before dcp.load reads it again: the
        # second read comes from the bytes of the first (one request fewer per rank on S3).
        data = self._metadata_bytes.get(str(path))
        if data is None:
            with self.fs.create_stream(path, "rb") as f:
                data = f.read()
            self._metadata_bytes[str(path)] = data
        if self.verifier is not None:
            problem = self.verifier.check_bytes(METADATA, data)
            if problem is not None:
                raise VerificationFailed([problem])
        try:
            md = read_metadata_safely(io.BytesIO(data))
        except (pickle.UnpicklingError, EOFError) as e:
            raise CheckpointCorruptError(f"{path}: refused to load ({e})") from e
        meta = getattr(md, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        md.storage_meta = meta
        return md

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        plan = super().prepare_local_plan(plan)
        if self.verifier is not None:
            self.verifier.check_ahead(self, plan)
        return plan

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        if self.verifier is None:
            return super().read_data(plan, planner)
        fs = self.fs
        assert isinstance(fs, VerifiedBytesFileSystem)
        fs.verified = dict(self.verifier.verify_for(self, plan))
        try:
            rest = [item for item in plan.items if not self._copy_in_place(item, planner)]
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        finally:
            fs.verified = {}

    def _copy_in_place(self, item: ReadItem, planner: LoadPlanner) -> bool:
        """Copy a tensor item from the verified bytes this rank keeps straight into its
        destination; False leaves the item to DCP's own read."""
        if item.type != LoadItemType.TENSOR:
            return False
        span = read_span(self, item.storage_index)
        data = None if span.transformed else self.fs.verified.get(span.file)
        if data is None:
            return False
        source = tensor_in_record(data, span.offset, span.length)
        if source is None:
            return False
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
            source = source.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != source.size():
            raise CheckpointCorruptError(
                f"{span.file}: record of {item.dest_index.fqn} holds {tuple(source.size())}, "
                f"the destination is {tuple(target.size())}"
            )
        target.copy_(source)
        planner.commit_tensor(item, target)
        return True


def make_reader(storage: Storage, rel: str, *, verifier: Verifier | None = None) -> Any:
    """A DCP storage reader for directory `rel` of `storage` that cannot execute pickled code;
    with a `verifier`, one that checks every file against the manifest as it reads (a
    collective inside dcp.load: every rank of the load must pass one)."""
    if storage.is_local:
        reader = _SafeReader(storage.path(rel))
    else:
        reader = _SafeReader(rel)
        reader.path = rel
        reader.fs = StorageFileSystem(storage)
    if verifier is not None:
        reader.verifier = verifier
        reader.fs = VerifiedBytesFileSystem(reader.fs)
    return reader


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor values with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        planner_store(self, read_item.dest_index.fqn, torch.load(value, weights_only=True))
