"""The work of `resilient export` (resilient/weights/export.py has the entry points and what
it guarantees): plan the tensors and their names, verify, stream them into safetensors
shards or a torch file inside the staging directory, log what was done.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from resilient.errors import ConfigError
from resilient.events import EXPORT_DONE, EXPORT_FAILED, EXPORT_START, EXPORT_VERIFIED
from resilient.log import get_logger
from resilient.version import __version__
from resilient.weights.checkpoint_reader import CheckpointWeights, open_checkpoint
from resilient.weights.layout import (
    INDEX_NAME,
    SINGLE_NAME,
    TORCH_NAME,
    ExportResult,
    shard_name,
)
from resilient.weights.names import KeyMap, load_key_map
from resilient.weights.progress import Progress
from resilient.weights.safetensors_out import SafetensorsWriter, dtype_code, write_order
from resilient.weights.staging import Staging, check_destination, local_destination
from resilient.weights.stream import Item, StreamReader, Times

__all__ = ["DTYPES", "write_export"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def write_export(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    step: int | None = None,
    fmt: str = "safetensors",
    dtype: str | None = None,
    model_only: bool = False,
    max_shard_bytes: int = 5_000_000_000,
    key_map: KeyMap | str | os.PathLike[str] | None = None,
    force: bool = False,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
) -> ExportResult:
    """`resilient.weights.export.export` (its arguments and what it raises are described
    there), once the arguments that need no torch are checked."""
    t0 = time.perf_counter()
    target = local_destination(dst)
    replace = check_destination(target, force=force)
    rename = load_key_map(key_map) if isinstance(key_map, (str, os.PathLike)) else key_map
    log = get_logger()
    with open_checkpoint(src, step=step, storage_options=storage_options) as ckpt:
        items = _plan(ckpt, rename, DTYPES.get(dtype or ""))
        total = sum(i.nbytes for i in items)
        log.info(
            EXPORT_START,
            src=ckpt.url,
            dst=str(target),
            step=ckpt.step,
            format=fmt,
            tensors=len(items),
            bytes=total,
        )
        times = Times()
        try:
            # every file, before anything is written; from a remote source the records to
            # read are kept on the way, beside the destination (one transfer, not two)
            spool = target.with_name(f"{target.name}.source-{os.getpid()}")
            wanted = ("model.",) if fmt == "safetensors" or model_only else ("model.", "optim.")
            times.verify_s = ckpt.verify(spool=spool, prefixes=wanted)
            log.info(
                EXPORT_VERIFIED,
                files=len(ckpt.manifest.files),
                bytes=ckpt.manifest.total_bytes,
                seconds=round(times.verify_s, 3),
            )
            meter = Progress(total, enabled=sys.stderr.isatty() if progress is None else progress)
            with Staging(target, replace=replace) as tmp:
                if fmt == "safetensors":
                    _write_safetensors(ckpt, items, tmp, max_shard_bytes, meter, times)
                else:
                    _write_torch(ckpt, items, tmp, model_only, rename, meter, times)
            meter.finish()
        except BaseException as e:
            log.error(
                EXPORT_FAILED,
                src=ckpt.url,
                dst=str(target),
                error=ckpt.redact(f"{type(e).__name__}: {e}"),
            )
            raise
        result = ExportResult(
            files=times.files,
            tensors=len(items),
            bytes=total,
            seconds=round(time.perf_counter() - t0, 4),
            step=ckpt.step,
            verify_s=round(times.verify_s, 4),
            read_s=round(times.read_s, 4),
            write_s=round(times.write_s, 4),
        )
        log.info(
            EXPORT_DONE,
            src=ckpt.url,
            dst=str(target),
            step=ckpt.step,
            format=fmt,
            files=len(result.files),
            tensors=result.tensors,
            bytes=result.bytes,
            seconds=result.seconds,
            verify_s=round(times.verify_s, 3),
            read_s=round(times.read_s, 3),
            write_s=round(times.write_s, 3),
        )
    return result


# ---------------------------------------------------------------------- planning
def _plan(ckpt: CheckpointWeights, rename: KeyMap | None, dtype: torch.dtype | None) -> list[Item]:
    """The tensors to export, in the checkpoint's order, with their exported names and
    dtypes; ConfigError when two end up with one name, or none is left."""
    items: list[Item] = []
    taken: dict[str, str] = {}
    for source, spec in ckpt.specs.items():
        name = rename(source) if rename is not None else source
        if name is None:
            continue
        if not isinstance(name, str) or not name:
            raise ConfigError(
                f"key_map({source!r}) returned {name!r}: it must return a non-empty str (the "
                "new name) or None (drop the key)"
            )
        if name in taken:
            raise ConfigError(
                f"keys {ckpt.specs[taken[name]].saved_key!r} and {spec.saved_key!r} of "
                f"{ckpt.url} would both be exported as {name!r}: change the --map"
            )
        taken[name] = source
        out = dtype if dtype is not None and spec.dtype.is_floating_point else spec.dtype
        items.append(Item(name, source, out, spec.shape))
    if not items:
        raise ConfigError(f"nothing to export: the --map dropped all {len(ckpt.specs)} keys")
    return items


def _shards(items: list[Item], max_bytes: int) -> list[list[Item]]:
    """`items` cut in order into shards of at most `max_bytes` (a larger tensor alone)."""
    shards: list[list[Item]] = [[]]
    size = 0
    for item in items:
        if shards[-1] and size + item.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item.nbytes
    return shards


def _metadata(ckpt: CheckpointWeights) -> dict[str, str]:
    """Each safetensors file's "__metadata__" (str to str): "format": "pt" (transformers'
    from_pretrained refuses a file without it) and where the weights came from."""
    return {
        "format": "pt",
        "step": str(ckpt.step),
        "source": ckpt.redact(ckpt.url),
        "resilient_version": __version__,
        "torch_version": str(torch.__version__),
    }


def _write_safetensors(
    ckpt: CheckpointWeights,
    items: list[Item],
    tmp: Path,
    max_shard_bytes: int,
    meter: Progress,
    times: Times,
) -> None:
    for item in items:
        dtype_code(item.dtype, item.name)  # every dtype fits, before the first file
    shards = _shards(items, max_shard_bytes)
    n = len(shards)
    names = [SINGLE_NAME] if n == 1 else [shard_name(i + 1, n) for i in range(n)]
    metadata = _metadata(ckpt)
    entries = [[(i.name, i.dtype, i.shape) for i in shard] for shard in shards]
    orders = [write_order(e) for e in entries]
    # one stream over every shard: the next shard's first batch is read while this one ends
    stream = StreamReader(ckpt, times, reuse=True).tensors(
        [shard[k] for shard, order in zip(shards, orders, strict=True) for k in order]
    )
    try:
        for file, shard, entry in zip(names, shards, entries, strict=True):
            writer = SafetensorsWriter(tmp / file, entry, metadata)
            try:
                for _ in shard:
                    item, tensor = next(stream)
                    t = time.perf_counter()
                    meter.add(writer.write(item.name, tensor))
                    del tensor
                    times.write_s += time.perf_counter() - t
                t = time.perf_counter()
                writer.close()
                times.write_s += time.perf_counter() - t
            except BaseException:
                writer.abort()
                raise
            times.files.append(file)
    finally:
        stream.close()  # a read under way ends before the files go
    if n > 1:
        index = {
            "metadata": {"total_size": sum(i.nbytes for i in items), **_metadata(ckpt)},
            "weight_map": {
                i.name: file for file, shard in zip(names, shards, strict=True) for i in shard
            },
        }
        _write_file(tmp / INDEX_NAME, json.dumps(index, indent=2).encode() + b"\n")
        times.files.append(INDEX_NAME)


def _write_torch(
    ckpt: CheckpointWeights,
    items: list[Item],
    tmp: Path,
    model_only: bool,
    rename: KeyMap | None,
    meter: Progress,
    times: Times,
) -> None:
    model: dict[str, torch.Tensor] = {}
    for item, tensor in StreamReader(ckpt, times, reuse=False).tensors(items):
        assert isinstance(tensor, torch.Tensor)  # whole tensors without reuse
        model[item.name] = tensor
    obj: Any = model
    if not model_only:
        t = time.perf_counter()
        optimizer = ckpt.read_optimizer(rename or (lambda name: name))
        times.read_s += time.perf_counter() - t
        obj = {"model": model, "optimizer": optimizer, "step": ckpt.step}
    t = time.perf_counter()
    with open(tmp / TORCH_NAME, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    times.write_s += time.perf_counter() - t
    meter.add(sum(i.nbytes for i in items))
    times.files.append(TORCH_NAME)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
