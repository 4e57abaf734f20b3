"""The tensors of one resilient checkpoint, read by a single process a few at a time.

No process group: one process opens a checkpoint saved by any number of ranks (DDP, FSDP2
or a plain module; local or any fsspec URL), names its model tensors by plain name with their
dtype and shape from DCP's metadata alone, checks every file against the manifest, and loads
the tensors asked for, and only those, through `dcp.load` (DCP reassembles FSDP2's shards
into full tensors). Memory holds what one `read` asked for, not the checkpoint.

It reuses the checkpoint manager's pieces: listing and manifests, `CheckpointManager.verify`
(the check `resilient verify` runs), and the restricted DCP reader (`make_reader`,
`SafeLoadPlanner`): `.metadata` is checked against the manifest before it is unpickled, and
neither it nor any value runs code.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from resilient.checkpoint import CheckpointConfig, CheckpointManager
from resilient.checkpoint._dcp_errors import why
from resilient.checkpoint._dcp_read import (
    SafeLoadPlanner,
    Verifier,
    make_reader,
    read_metadata_safely,
)
from resilient.checkpoint._torch_archive import tensor_in_record
from resilient.checkpoint._torch_compat import read_span
from resilient.checkpoint.manifest import Manifest, step_dir
from resilient.errors import CheckpointCorruptError, CheckpointError, ConfigError
from resilient.storage import Buffer
from resilient.storage.checksum import updater
from resilient.storage.local import map_file
from resilient.weights.names import plain_name
from resilient.weights.optim_state import nest, renamed
from resilient.weights.sources import step_location
from resilient.weights.spool import record_ranges, spool_checkpoint

__all__ = ["CheckpointWeights", "TensorSpec", "buffer_bytes", "open_checkpoint"]

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
_METADATA = ".metadata"
_ALIGN = 64
"""Tensors carved out of a read buffer start at multiples of this many bytes."""


class TensorSpec(NamedTuple):
    """A model tensor of the checkpoint, as its metadata describes it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    saved_key: str
    """Its key in the DCP checkpoint (`model.<fqn>`)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def open_checkpoint(
    url: str | os.PathLike[str],
    *,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> CheckpointWeights:
    """Checkpoint `step` (default: the newest committed) under location `url`; a `step_*`
    directory of it names its step. Reads its manifest and DCP metadata, nothing else yet.

    CheckpointError (one line: the URL and what to do) for a location without checkpoints,
    a step that is not there (naming the steps there are), a directory that is not a
    resilient checkpoint; CheckpointCorruptError for a manifest or `.metadata` that does not
    read or does not match.
    """
    text = os.fspath(url)
    named = step_location(text, step)
    if named is not None:
        text, step = named[0] or "/", named[1]
    mgr = CheckpointManager(
        CheckpointConfig(url=text, storage_options=dict(storage_options or {}), async_save=False)
    )
    try:
        chosen, committed = _pick_step(mgr, step)
        return CheckpointWeights(mgr, chosen, others=[s for s in committed if s != chosen])
    except BaseException:
        mgr.close()
        raise


def _pick_step(mgr: CheckpointManager, step: int | None) -> tuple[int, list[int]]:
    """The step to export, and the committed steps of the location."""
    storage = mgr.storage
    where = storage.url
    if storage.is_local and os.path.isfile(storage.root):
        raise CheckpointError(
            f"{where} is a file, not a checkpoint location: give the directory a run saved to "
            "(it holds step_*/manifest.json)"
        )
    if storage.is_local and not os.path.isdir(storage.root):
        raise CheckpointError(
            f"{where} does not exist: give the checkpoint location a run saved to (it holds "
            "step_*/manifest.json)"
        )
    infos = mgr.list()
    committed = [i.step for i in infos if i.committed]
    if not committed:
        if infos:
            raise CheckpointError(
                f"no committed checkpoint under {where}: its step_* directories "
                f"({', '.join(step_dir(i.step) for i in infos[:5])}) have no manifest.json "
                "(saves that never finished); export a location with a finished save"
            )
        raise CheckpointError(
            f"{where} is not a resilient checkpoint location: no step_*/manifest.json under "
            "it; give the directory a run saved to (checkpoint_dir), or one step_* in it"
        )
    if step is None:
        return committed[-1], committed
    if step not in committed:
        unfinished = " (its directory has no manifest.json: a save that never finished)"
        raise CheckpointError(
            f"no committed checkpoint at step {step} under {where}"
            + (unfinished if any(i.step == step for i in infos) else "")
            + f": it has steps {committed}; pass one of them with --step"
        )
    return step, committed


class CheckpointWeights:
    """One checkpoint of a location: its model tensors by plain name, verified and read on
    demand. Single process; close() when done (or use it as a context manager)."""

    def __init__(self, mgr: CheckpointManager, step: int, *, others: list[int]) -> None:
        self._mgr = mgr
        self.storage = mgr.storage
        self.step = step
        self.rel = step_dir(step)
        self.location = self.storage.url
        """The checkpoint location (credentials hidden)."""
        self.url = f"{self.location.rstrip('/')}/{self.rel}"
        """This checkpoint's directory (credentials hidden)."""
        self.others = others
        """The location's other committed steps (for error messages)."""
        try:
            self.manifest: Manifest = mgr.read_manifest(step)
        except CheckpointCorruptError as e:
            raise CheckpointCorruptError(f"{e}{self._try_another()}") from e
        except FileNotFoundError as e:  # deleted since the listing (retention)
            raise CheckpointError(f"{self.url}: manifest.json is gone ({e})") from e
        self.metadata: Metadata = self._read_metadata()
        self.specs: dict[str, TensorSpec] = self._model_specs()
        """plain name -> TensorSpec, in the checkpoint's (the model's state dict) order."""
        self._files = _MappedFiles(
            storage=self.storage,
            rel=self.rel,
            manifest=self.manifest,
            rank=0,
            world_size=1,
            gather=lambda obj: [obj],
            buffer_bytes=0,
            root=self.storage.path(self.rel) if self.storage.is_local else None,
        )
        self._reader = make_reader(self.storage, self.rel, verifier=self._files)
        self._spool: Path | None = None

    def __enter__(self) -> CheckpointWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the manager, and delete the local copy `verify` made, if any."""
        self._mgr.close()
        spool, self._spool = self._spool, None
        if spool is not None:
            self._files.root = None
            shutil.rmtree(spool, ignore_errors=True)

    def redact(self, text: str) -> str:
        return self.storage.redact(text)

    # ------------------------------------------------------------------ checks
    def verify(
        self, *, spool: Path | None = None, prefixes: tuple[str, ...] = (MODEL_PREFIX,)
    ) -> float:
        """Check every file against the manifest (size and checksum, every byte read);
        CheckpointCorruptError naming each file that fails with the expected and found
        values. Returns the seconds it took.

        `spool` (a remote checkpoint only): a new local directory that keeps the records of
        the entries under `prefixes` as they stream by, for the reads after it (one transfer
        instead of two; resilient/weights/spool.py). close() deletes it.
        """
        t0 = time.perf_counter()
        if spool is None or self.storage.is_local:
            problems = self._mgr.verify(self.step, self.manifest)
        else:
            if spool.exists():
                raise ConfigError(f"{spool} exists: give a new directory for the local copy")
            self._spool = spool
            ranges = record_ranges(self.metadata, prefixes)
            try:
                problems = spool_checkpoint(self.storage, self.rel, self.manifest, ranges, spool)
            except FileNotFoundError as e:  # deleted meanwhile: as missing
                problems = [f"{e}"]
            if not problems:
                self._files.root, self._files.only = str(spool), frozenset(ranges)
        if problems:
            raise CheckpointCorruptError(
                f"checkpoint {self.url} failed verification: {'; '.join(problems)}"
                + self._try_another()
            )
        return time.perf_counter() - t0

    def _try_another(self) -> str:
        if not self.others:
            return "; it is the only committed checkpoint there"
        return f"; export another step with --step (it has {self.others})"

    def _read_metadata(self) -> Metadata:
        """DCP's metadata, checked against the manifest before it is unpickled."""
        want = self.manifest.files.get(_METADATA)
        where = f"{self.url}/{_METADATA}"
        if want is None:
            raise CheckpointCorruptError(
                f"{where}: not listed in the manifest; not a DCP checkpoint this resilient "
                "wrote" + self._try_another()
            )
        try:
            data = self.storage.read_bytes(f"{self.rel}/{_METADATA}")
        except FileNotFoundError:
            raise CheckpointCorruptError(
                f"{where}: missing (expected {want.size} bytes)" + self._try_another()
            ) from None
        value = updater(self.manifest.checksum)(data, 0)
        if len(data) != want.size or value != want.checksum:
            found = f"{len(data)} bytes, {self.manifest.checksum} {value:08x}"
            raise CheckpointCorruptError(
                f"{where}: {found} != expected {want.size} bytes, {want.checksum:08x} "
                "(truncated or corrupt)" + self._try_another()
            )
        try:
            return read_metadata_safely(io.BytesIO(data))
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
            raise CheckpointCorruptError(
                f"{where}: not DCP metadata this resilient reads ({e})" + self._try_another()
            ) from e

    def _model_specs(self) -> dict[str, TensorSpec]:
        specs: dict[str, TensorSpec] = {}
        for key, md in self.metadata.state_dict_metadata.items():
            if not key.startswith(MODEL_PREFIX) or not isinstance(md, TensorStorageMetadata):
                continue
            name = plain_name(key[len(MODEL_PREFIX) :])
            if name in specs:
                raise CheckpointError(
                    f"{self.url}: keys {specs[name].saved_key!r} and {key!r} are both {name!r} "
                    "once wrapper prefixes are taken off"
                )
            specs[name] = TensorSpec(md.properties.dtype, tuple(md.size), key)
        if not specs:
            raise CheckpointError(
                f"{self.url} holds no model tensors (no `model.*` entries): it was saved "
                "without a model"
            )
        return specs

    # ------------------------------------------------------------------ reads
    def read(
        self, names: Iterable[str], *, into: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """The full tensors `names` (plain names of `specs`), in their saved dtype, loaded
        together by one dcp.load; nothing else of the checkpoint is read into memory.

        `into`: a uint8 buffer of at least `buffer_bytes` of these specs; the tensors are
        then views of it, valid until it is read into again (a buffer used over and over
        costs no fresh memory per read). Without it, fresh tensors.
        """
        names = list(names)
        template: dict[str, Any] = {}
        offset = 0
        for name in names:
            spec = self.specs[name]
            if into is None:
                template[spec.saved_key] = torch.empty(spec.shape, dtype=spec.dtype)
                continue
            end = offset + spec.nbytes
            if end > into.numel():
                raise ValueError(f"read buffer of {into.numel()} bytes is too small")
            template[spec.saved_key] = into[offset:end].view(spec.dtype).view(spec.shape)
            offset = end + (-end % _ALIGN)
        self._load(template)
        return {name: template[self.specs[name].saved_key] for name in names}

    def pieces(self, name: str) -> list[torch.Tensor] | None:
        """Tensor `name`'s bytes in C order, without a copy: views of its records where they
        lie in memory maps of local files (the checkpoint's own, or the copy `verify` kept),
        one per saved chunk. That is, when it was saved whole or in runs of whole rows (FSDP2
        shards dim 0) and each record holds a plain contiguous tensor; None otherwise (read
        it with `read`). The maps go when the views do."""
        root, spec = self._files.root, self.specs[name]
        md = self.metadata.state_dict_metadata[spec.saved_key]
        if root is None or not isinstance(md, TensorStorageMetadata):
            return None
        if not _whole_rows(md, spec.shape):
            return None
        views = []
        where = SimpleNamespace(storage_data=self.metadata.storage_data)
        for chunk in sorted(md.chunks, key=lambda c: tuple(c.offsets)):
            if 0 in chunk.sizes:
                continue  # a rank that held none of it
            span = read_span(where, MetadataIndex(spec.saved_key, chunk.offsets))  # type: ignore[arg-type]
            entry = self.manifest.files.get(span.file)
            if span.transformed or entry is None or not self._files.holds(span.file):
                return None
            mapped = map_file(os.path.join(root, span.file), entry.size, span.file)
            view = tensor_in_record(mapped, span.offset, span.length)
            if (
                view is None
                or view.dtype != spec.dtype
                or tuple(view.shape) != tuple(chunk.sizes)
                or not view.is_contiguous()
            ):
                return None
            views.append(view)
        return views

    def has_optimizer(self) -> bool:
        return any(k.startswith(OPTIM_PREFIX) for k in self.metadata.state_dict_metadata)

    def read_optimizer(self, rename: Callable[[str], str | None]) -> dict[str, Any]:
        """The optimizer state in torch's nested `get_optimizer_state_dict` form, rebuilt from
        DCP's flat entries (`optim.*`) through the flattening map in the metadata
        (`planner_data`: flat key -> its path in the nested dict). Parameter names go
        through `rename` (plain name -> new name, None drops it) as the model's keys do. Held
        in memory whole."""
        saved = self.metadata.state_dict_metadata
        paths = self.metadata.planner_data
        keys = [k for k in saved if k.startswith(OPTIM_PREFIX)]
        if not keys:
            raise CheckpointError(f"{self.url} holds no optimizer state; use --model-only")
        template: dict[str, Any] = {}
        for key in keys:
            md = saved[key]
            if not isinstance(paths, dict) or not isinstance(paths.get(key), tuple):
                raise CheckpointCorruptError(
                    f"{self.url}/{_METADATA}: no nesting path for {key!r} in its planner data"
                )
            if isinstance(md, TensorStorageMetadata):
                template[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            else:
                template[key] = None  # a pickled value (a param group's lr, its params)
        self._load(template)
        return renamed(nest(template, paths), rename)

    def _load(self, template: dict[str, Any]) -> None:
        if not template:
            return
        try:
            dcp.load(template, storage_reader=self._reader, planner=SafeLoadPlanner(), no_dist=True)
        except CheckpointException as e:
            raise CheckpointError(self.redact(f"{self.url}: reading failed: {why(e)}")) from e
        except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as e:
            raise CheckpointError(
                self.redact(f"{self.url}: reading failed: {type(e).__name__}: {e}")
            ) from e


def _whole_rows(md: TensorStorageMetadata, shape: tuple[int, ...]) -> bool:
    """Whether `md`'s chunks are runs of whole rows that tile the tensor in order (or one
    chunk, the whole of it): their bytes, one after the other, are the tensor's."""
    chunks = sorted(md.chunks, key=lambda c: tuple(c.offsets))
    if not shape:
        return len(chunks) == 1
    row = 0
    for chunk in chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if offsets[0] != row or any(offsets[1:]) or sizes[1:] != shape[1:]:
            return False
        row += sizes[0]
    return row == shape[0]


def buffer_bytes(specs: Iterable[TensorSpec]) -> int:
    """The size of a buffer that `CheckpointWeights.read(..., into=)` needs for `specs`."""
    total = 0
    for spec in specs:
        total += spec.nbytes + (-spec.nbytes % _ALIGN)
    return total


@dataclass(kw_only=True, slots=True)
class _MappedFiles(Verifier):
    """Serves dcp.load's reads from memory maps of local files: the checkpoint's own
    (local) or the copy `verify` kept (remote). The restricted reader copies from them
    straight into the destination tensors (no fresh tensor per record, no second copy).
    The checks are `CheckpointWeights.verify`'s, done before: nothing is checked here
    again. Maps last one read: their pages leave the process with them."""

    root: str | None = None
    """The local directory of the files; None: none mapped, every read goes to storage."""
    only: frozenset[str] | None = None
    """The files there (None: all of the manifest's)."""

    def holds(self, name: str) -> bool:
        return self.root is not None and (self.only is None or name in self.only)

    def verify_for(self, reader: Any, plan: Any) -> dict[str, Buffer]:
        if self.root is None:
            return {}
        files = {read_span(reader, item.storage_index).file for item in plan.items}
        return {
            name: map_file(os.path.join(self.root, name), entry.size, name)
            for name in sorted(files)
            if (entry := self.manifest.files.get(name)) is not None
            and entry.size > 0
            and (self.only is None or name in self.only)
        }

    def check_ahead(self, reader: Any, plan: Any) -> None:
        return None
