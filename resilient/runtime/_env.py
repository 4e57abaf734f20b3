"""Environment parsing for the runtime, re-exported from resilient/envvars.py (the contract
between `resilient run` and its workers: every variable's name and meaning)."""

from resilient.envvars import json_object_env

__all__ = ["json_object_env"]
