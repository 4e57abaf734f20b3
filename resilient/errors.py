"""The exceptions callers need to tell apart. Everything else raises built-ins."""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "ConfigError",
    "DivergentStateError",
    "NumericalFaultError",
    "ResilientError",
    "StorageError",
]


class ResilientError(Exception):
    """Base class of every error raised on purpose by resilient."""


class ConfigError(ResilientError, ValueError):
    """A configuration value is out of range or inconsistent; the message says how to fix it."""


class StorageError(ResilientError, OSError):
    """The checkpoint location cannot be used (missing, not writable, retries exhausted)."""


class CheckpointError(ResilientError):
    """A checkpoint could not be saved or loaded."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint failed verification: a file is missing, truncated or its checksum differs."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint does not fit the tracked state (another model, missing or extra keys)."""


class DivergentStateError(CheckpointMismatchError):
    """A save where ranks hold different values under one plain name, which a checkpoint
    would keep only one of; refused before anything is written (checkpoint/duplicates.py)."""


class NumericalFaultError(ResilientError):
    """Training state or a checkpoint holds a non-finite value (NaN or inf), or a loss spiked
    past its threshold; the message names the step, the rank and what was seen."""
