"""What an export writes: its formats and file names, and what `export` returns. No torch
here: the `resilient` command builds its parser from these without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DTYPE_NAMES",
    "FORMATS",
    "INDEX_NAME",
    "SINGLE_NAME",
    "TORCH_NAME",
    "ExportResult",
    "shard_name",
]

FORMATS = ("safetensors", "torch")
DTYPE_NAMES = ("bf16", "fp16", "fp32")
INDEX_NAME = "model.safetensors.index.json"
"""Hugging Face's index of a sharded safetensors checkpoint."""
SINGLE_NAME = "model.safetensors"
"""The one file of a model that fits one shard (as save_pretrained names it)."""
TORCH_NAME = "model.pt"
"""The one file of --format torch."""


def shard_name(i: int, n: int) -> str:
    """Hugging Face's name of shard `i` (from 1) of `n`."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What `export` wrote."""

    files: list[str]
    """The files under the destination, by name (shards, index or model.pt)."""
    tensors: int
    """Model tensors exported."""
    bytes: int
    """Bytes of model tensors written (as exported: after any dtype conversion)."""
    seconds: float
    step: int
    """The checkpoint step exported."""
    verify_s: float = 0.0
    """Of `seconds`: checking every file against the manifest."""
    read_s: float = 0.0
    """Of `seconds`: reading tensors (dcp.load) and converting their dtype."""
    write_s: float = 0.0
    """Of `seconds`: writing and fsyncing the files."""
