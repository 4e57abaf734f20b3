"""`resilient export`: a checkpoint's model as Hugging Face safetensors shards or a torch file.

    resilient export SRC --to DST [--step N] [--format safetensors|torch] [--dtype bf16]
                     [--model-only] [--max-shard-size 5GB] [--map FILE.py] [--force]

The entry points (`export`, and `add_parser` / `main` for the `resilient` command) load
nothing heavy: torch and DCP come with resilient/weights/writer.py, which does the work,
when an export runs. What it guarantees (docs/checkpoints.md#export):
- Verified first: every file of the checkpoint is checked against its manifest before a
  byte is written; a checkpoint that fails exports nothing, and the error names the file.
- One transfer from a remote source: the check streams each file and keeps the records to
  export in a sparse local copy beside DST (`<DST>.source-<pid>`, deleted at the end), which
  the reads then map (resilient/weights/spool.py). It takes the disk space of those records.
- Streaming (safetensors): each shard's header is known up front from the checkpoint's
  metadata (resilient/weights/safetensors_out.py), then the tensors follow one by one
  (resilient/weights/stream.py): a tensor kept as saved is written straight from memory
  maps of the checkpoint's records (no copy), the others (a dtype conversion, a layout
  other than whole rows) are read by dcp.load a batch at a time (at most 256 MiB,
  or one tensor when it is larger), the next batch while this one is written. Peak memory
  is about two batches, whatever the model's size. The torch format is not bounded:
  torch.save needs the whole dict in memory.
- Atomic, never overwriting, local (resilient/weights/staging.py): written into
  `<DST>.partial-<pid>` and renamed to DST when complete; an existing DST is refused unless
  `force`. The source may be any fsspec URL (s3:// ...); the destination is a local path.
- Keys are plain (resilient/weights/names.py), then renamed by `key_map` if given; two saved
  keys that end up with one name are refused, naming both.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from resilient.errors import CheckpointCorruptError, ConfigError, ResilientError
from resilient.weights.layout import DTYPE_NAMES, FORMATS, INDEX_NAME, ExportResult
from resilient.weights.progress import parse_size

if TYPE_CHECKING:
    from resilient.weights.names import KeyMap

__all__ = ["INDEX_NAME", "ExportResult", "add_parser", "export", "main"]


def export(
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
    """Export the model of checkpoint `step` (default: the newest committed) under `src` to
    the local directory `dst`.

    `fmt`: "safetensors" (the model alone, always: Hugging Face's layout, shards of at most
    `max_shard_bytes`, a tensor larger than that in a shard of its own) or "torch" (one
    `model.pt`: the plain model state dict with `model_only`, else {"model", "optimizer",
    "step"} with the optimizer state in get_optimizer_state_dict's nested form). `dtype`:
    "bf16", "fp16" or "fp32" converts floating-point model tensors (integer and bool ones
    are kept). `key_map`: rename(name) -> new name or None (dropped), or the path of a
    Python file defining it. `progress`: a progress line on stderr (None: when it is a
    terminal). Raises ConfigError (arguments, an existing destination without `force`),
    CheckpointError and CheckpointCorruptError (the source), with nothing written.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"format {fmt!r}: choose one of {list(FORMATS)}")
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ConfigError(f"dtype {dtype!r}: choose one of {list(DTYPE_NAMES)} (or none: as saved)")
    if max_shard_bytes < 1:
        raise ConfigError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    from resilient.weights.writer import write_export  # torch and DCP: loaded on use

    return write_export(
        src,
        dst,
        step=step,
        fmt=fmt,
        dtype=dtype,
        model_only=model_only,
        max_shard_bytes=max_shard_bytes,
        key_map=key_map,
        force=force,
        progress=progress,
        storage_options=storage_options,
    )


# ---------------------------------------------------------------------- command line
def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add `export` to the `resilient` command's subparsers `sub`; runs `main`."""
    p = sub.add_parser(
        "export",
        help="write a checkpoint's model as Hugging Face safetensors (or a torch.save file)",
        description="Write the model of a resilient checkpoint as Hugging Face safetensors "
        "shards (model-0000K-of-0000N.safetensors and model.safetensors.index.json; one "
        "model.safetensors when it fits one shard) or one torch.save file. Every file of the "
        "checkpoint is verified against its manifest before anything is written; the result "
        "appears at once, by a rename, and never overwrites without --force.",
        epilog="exit codes: 0 exported; 1 the checkpoint failed verification (nothing "
        "written); 2 anything else that stopped it (nothing written)",
    )
    p.add_argument(
        "src",
        help="checkpoint location (directory or fsspec URL, s3://...) or "
        "one of its step_* directories",
    )
    p.add_argument("--to", dest="dst", required=True, help="local directory to create")
    p.add_argument("--step", type=int, default=None, help="default: the newest committed")
    p.add_argument(
        "--format",
        dest="fmt",
        choices=FORMATS,
        default="safetensors",
        help="safetensors (default) always holds the model alone; torch writes "
        "model.pt: {'model', 'optimizer', 'step'}, or the model state dict alone "
        "with --model-only (held in memory whole)",
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPE_NAMES),
        default=None,
        help="convert floating-point model tensors (default: as saved)",
    )
    p.add_argument(
        "--model-only", action="store_true", help="--format torch: the model's state dict alone"
    )
    p.add_argument(
        "--max-shard-size",
        dest="max_shard_bytes",
        type=parse_size,
        default=5_000_000_000,
        metavar="SIZE",
        help="largest safetensors shard: 5GB (default), 500MB, 2GiB or bytes; a "
        "larger tensor gets a shard of its own",
    )
    p.add_argument(
        "--map",
        dest="key_map",
        default=None,
        metavar="FILE.py",
        help="Python file defining rename(name) -> new name, or None to drop the "
        "key; applied to the plain names",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing destination (once the new export is complete)",
    )
    p.set_defaults(fn=main)
    return p


def main(args: argparse.Namespace) -> int:
    """Run `resilient export` with parsed `args`; prints one line of what was written."""
    try:
        result = export(
            args.src,
            args.dst,
            step=args.step,
            fmt=args.fmt,
            dtype=args.dtype,
            model_only=args.model_only,
            max_shard_bytes=args.max_shard_bytes,
            key_map=args.key_map,
            force=args.force,
        )
    except CheckpointCorruptError as e:
        print(f"resilient export: {e}; nothing was written", file=sys.stderr)
        return 1
    except ResilientError as e:
        print(f"resilient export: {e}", file=sys.stderr)
        return 2
    print(
        f"exported step {result.step}: {result.tensors} tensors, {result.bytes:,} bytes in "
        f"{len(result.files)} file(s) to {os.path.abspath(args.dst)} ({result.seconds:.1f} s)"
    )
    return 0
