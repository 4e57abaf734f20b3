"""The exit codes, re-exported where they used to live: see resilient/exitcodes.py (the
contract between workers and their launcher, shared with resilient/supervisor/)."""

from resilient.exitcodes import DESCRIPTIONS, RESTARTABLE, ExitCode, describe

__all__ = ["DESCRIPTIONS", "RESTARTABLE", "ExitCode", "describe"]
