"""Storage retries must not touch the training RNG."""

from __future__ import annotations

import random

from resilient.storage import RetryPolicy


def test_storage_retries_leave_the_global_python_rng_alone():
    """Backoff jitter must not draw from `random`: a resumed run's draws would shift."""
    calls = {"n": 0}

    def flaky() -> str:
        calls["n"] += 1
        if calls["n"] < 4:
            raise ConnectionError("reset by peer")
        return "ok"

    random.seed(1234)
    expected = random.random()
    random.seed(1234)
    waits: list[float] = []
    assert RetryPolicy(sleep=waits.append).call("flaky", flaky) == "ok"
    assert len(waits) == 3 and all(w > 0 for w in waits)
    assert random.random() == expected
