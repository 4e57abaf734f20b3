"""Configuration from environment variables that hold a JSON object ($RESILIENT_WATCHDOG,
$RESILIENT_PREEMPT): how `resilient run`, a chaos harness or a job script sets options of
workers it does not edit."""

from __future__ import annotations

import json
import os
from typing import Any

from resilient.errors import ConfigError


def json_object_env(name: str) -> dict[str, Any]:
    """The JSON object in $`name` ({} when unset or blank). ConfigError naming the variable
    when it is not a JSON object."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return {}
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"${name} is not a JSON object: {e}") from e
    if not isinstance(parsed, dict):
        raise ConfigError(f"${name} must be a JSON object, got {raw!r}")
    return parsed
