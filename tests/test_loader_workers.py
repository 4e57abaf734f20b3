"""A tracked loader's workers outlive a preemption signal sent to the whole process group.

The loaders fork their workers from the pytest process, which under pytest-xdist runs
threads of its own: `solo` runs them in the single-worker part of `make test`.
"""

from __future__ import annotations

import signal
import subprocess

import psutil
import pytest
from helpers import mark_worker
from torchdata.stateful_dataloader import StatefulDataLoader

from resilient.preempt.loader_workers import shield_workers

pytestmark = pytest.mark.solo


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_workers_ignore_a_preemption_signal_from_another_process(sig: signal.Signals) -> None:
    loader = StatefulDataLoader(
        list(range(64)), batch_size=2, num_workers=2, worker_init_fn=mark_worker
    )
    shield_workers(loader, [signal.SIGTERM, signal.SIGUSR1])
    it = iter(loader)
    # a batch from each worker (they take turns): both have run their init, the shield's
    # handlers included (a signal before that meets torch's own handler, under load)
    first = [int(x) for _ in range(2) for x in next(it)]
    workers = [psutil.Process(w.pid) for w in it._workers]  # type: ignore[attr-defined]
    # sent by another process, as torch elastic's killpg is: torch's own handler would die
    subprocess.run(["kill", f"-{sig.name}", *(str(w.pid) for w in workers)], check=True)
    rest = [int(x) for batch in it for x in batch]
    assert first + rest == list(range(64))  # every batch still came, in order
    assert all(w.status() != psutil.STATUS_ZOMBIE for w in workers if w.is_running())


def test_a_loader_without_workers_is_left_alone() -> None:
    loader = StatefulDataLoader(list(range(4)), batch_size=2, num_workers=0)
    shield_workers(loader, [signal.SIGTERM])
    assert loader.worker_init_fn is None


@pytest.mark.timeout(60)
def test_a_signal_from_the_rank_itself_still_ends_a_worker() -> None:
    # what the loader's and multiprocessing's terminate() at shutdown rely on
    loader = StatefulDataLoader(list(range(64)), batch_size=2, num_workers=1)
    shield_workers(loader, [signal.SIGTERM])
    it = iter(loader)
    next(it)
    worker = it._workers[0]  # type: ignore[attr-defined]
    worker.terminate()  # SIGTERM from this process, the worker's parent
    worker.join(timeout=10)
    assert worker.exitcode == 0, worker.exitcode  # left as torch's own handler would
    del it
