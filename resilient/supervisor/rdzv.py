"""A rendezvous store apart from the job: the checks at start, and a handler that outlives it.

`resilient run --rdzv-external` (and torch's `etcd-v2` backend, whose store is always apart)
says that no training node hosts the rendezvous: every node is a client of a store served
elsewhere (`resilient rendezvous`, store_server.py, or an etcd cluster), so the loss of any
node, the first one too, is the loss of one node (docs/operating.md#the-rendezvous-store).

- `check_external`: before anything starts, the store must answer within `wait_s` (else an
  error naming the endpoint, not a hang), an etcd endpoint must serve etcd's v2 API (torch's
  etcd-v2 backend speaks no other), and the rendezvous id must not be held by another job on
  that store (a claim under storekeys.job_claim, compared by the job's fingerprint).
- `StoreOutliving`: torch's own handler (built by the registry, unchanged) behind a thin
  wrapper. A TCPStore client never reconnects once its server went away (measured with torch
  2.13: every later call fails with "Broken pipe"), so when the store restarts, the running
  round goes on (the agent's look for waiting nodes answers 0 and says so once, instead of
  failing the agent) while a thread builds a fresh handler, and the next round joins through
  the fresh one. Events in the supervisor's log: `rdzv.store_lost` (a warning: when, during
which call), `rdzv.store_back` (with the outage's length).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import tenacity
from torch.distributed import DistError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from resilient import storekeys
from resilient.errors import ResilientError

__all__ = [
    "EXTERNAL_BACKENDS",
    "RendezvousStoreError",
    "StoreOutliving",
    "check_external",
    "job_fingerprint",
]

EXTERNAL_BACKENDS = ("etcd-v2",)
"""Backends whose store no training node ever hosts."""

_C10D_PORT, _ETCD_PORT = 29400, 2379


class RendezvousStoreError(ResilientError):
    """The rendezvous store cannot serve this job; the message names the endpoint."""


def job_fingerprint(
    *, entrypoint: str, args: list[str], nproc_per_node: int, nnodes: str, checkpoint: str | None
) -> str:
    """What every node of one job shares and two different jobs rarely do: the script and
    its arguments, the shape of the job, where it checkpoints."""
    what = json.dumps([entrypoint, args, nproc_per_node, nnodes, checkpoint])
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def _claim_record(fingerprint: str, command: str) -> str:
    return json.dumps(
        {
            "job": fingerprint,
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": command[:300],
        }
    )


def _refuse_if_other(held: str, fingerprint: str, run_id: str, where: str) -> None:
    try:
        other = json.loads(held)
    except ValueError:
        other = {"job": held}
    if other.get("job") != fingerprint:
        raise RendezvousStoreError(
            f"rendezvous id {run_id!r} on {where} is held by another job (started "
            f"{other.get('started', '?')} on {other.get('host', '?')}: "
            f"{other.get('command', '?')}); give this job its own --rdzv-id"
        )


def check_external(
    backend: str,
    endpoint: str,
    *,
    run_id: str,
    fingerprint: str,
    command: str,
    wait_s: float,
    protocol: str = "http",
) -> dict[str, Any]:
    """Check the external store before the job starts; returns what was found (for the
    supervisor's log). Raises RendezvousStoreError naming the endpoint."""
    if backend == "c10d":
        return _check_c10d(endpoint, run_id, fingerprint, command, wait_s)
    if backend in EXTERNAL_BACKENDS:
        return _check_etcd(endpoint, run_id, fingerprint, command, wait_s, protocol)
    raise RendezvousStoreError(
        f"--rdzv-external works with the c10d and etcd-v2 backends, not {backend!r}"
    )


def _check_c10d(
    endpoint: str, run_id: str, fingerprint: str, command: str, wait_s: float
) -> dict[str, Any]:
    from torch.distributed import TCPStore

    host, port = parse_rendezvous_endpoint(endpoint, default_port=_C10D_PORT)
    where = f"the rendezvous store at {host}:{port}"
    t0 = time.monotonic()
    try:
        # torch's client tries twice, each try up to its timeout: half of wait_s each
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=wait_s / 2))
    except (DistError, RuntimeError, ValueError) as e:
        raise RendezvousStoreError(
            f"{where} cannot be reached (waited {time.monotonic() - t0:.1f} s): "
            f"{str(e).splitlines()[0][:200].rstrip('.')}; start `resilient rendezvous "
            f"--port {port}` on {host}, or fix --rdzv-endpoint"
        ) from e
    server = None
    if store.check([storekeys.SERVER]):  # `resilient rendezvous` says who it is
        server = json.loads(bytes(store.get(storekeys.SERVER)))
    key = storekeys.job_claim(run_id)
    held = bytes(store.compare_set(key, "", _claim_record(fingerprint, command))).decode()
    _refuse_if_other(held, fingerprint, run_id, where)
    return {"endpoint": f"{host}:{port}", "server": server}


def _check_etcd(
    endpoint: str, run_id: str, fingerprint: str, command: str, wait_s: float, protocol: str
) -> dict[str, Any]:
    host, port = parse_rendezvous_endpoint(endpoint, default_port=_ETCD_PORT)
    base = f"{protocol}://{host}:{port}"
    where = f"the etcd endpoint {base}"

    def call(path: str, data: bytes | None = None, method: str = "GET") -> tuple[int, bytes]:
        req = urllib.request.Request(base + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/x-www-form-urlencoded")
        try:
            with urllib.request.urlopen(req, timeout=min(5.0, wait_s)) as r:
                return int(r.status), bytes(r.read())
        except urllib.error.HTTPError as e:
            return int(e.code), bytes(e.read())

    try:
        for attempt in tenacity.Retrying(
            stop=tenacity.stop_after_delay(wait_s),
            wait=tenacity.wait_fixed(0.5),
            retry=tenacity.retry_if_exception_type(OSError),
            reraise=True,
        ):
            with attempt:
                code, _ = call("/v2/keys")
    except OSError as e:
        raise RendezvousStoreError(
            f"{where} cannot be reached (waited {wait_s:g} s): {e}; fix --rdzv-endpoint"
        ) from e
    if code == 404:
        raise RendezvousStoreError(
            f"{where} does not serve etcd's v2 API, which torch's etcd-v2 backend needs: start "
            "etcd 3.4 or 3.5 with --enable-v2=true (3.6 has no v2 API), or use `resilient "
            "rendezvous` with --rdzv-backend c10d"
        )
    if code != 200:
        raise RendezvousStoreError(f"{where} answered HTTP {code} to a read of /v2/keys")
    path = "/v2/keys/" + storekeys.job_claim(run_id)
    record = _claim_record(fingerprint, command)
    body = urllib.parse.urlencode({"value": record}).encode()
    code, text = call(path + "?prevExist=false", body, "PUT")
    if code == 412:  # already there
        code, text = call(path)
        held = json.loads(text)["node"]["value"] if code == 200 else record
        _refuse_if_other(held, fingerprint, run_id, where)
    elif code not in (200, 201):
        raise RendezvousStoreError(f"{where} refused a write (HTTP {code}): {text[:200]!r}")
    return {"endpoint": base}


def _store_trouble(exc: BaseException) -> bool:
    """A failure of the store's connection, not of the rendezvous itself (a join timeout,
    a closed rendezvous)."""
    return isinstance(exc, (RendezvousConnectionError, DistError, ConnectionError))


class StoreOutliving(RendezvousHandler):
    """torch's handler, rebuilt when its store connection is lost (see module doc)."""

    def __init__(
        self,
        make: Callable[[], RendezvousHandler],
        *,
        first: RendezvousHandler | None = None,
        log: Any,
        endpoint: str,
        join_timeout_s: float,
        retry_every_s: float = 1.0,
    ) -> None:
        self._make = make
        self._inner = first if first is not None else make()
        self._log = log
        self._endpoint = endpoint
        self._join_timeout_s = join_timeout_s
        self._retry_every_s = retry_every_s
        self._lock = threading.Lock()
        self._lost_at: float | None = None
        self._closing = threading.Event()
        self._reconnector: threading.Thread | None = None

    # the handler's constants, from torch's own
    def get_backend(self) -> str:
        return self._inner.get_backend()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    @property
    def lost(self) -> bool:
        return self._lost_at is not None

    def _current(self) -> RendezvousHandler:
        with self._lock:
            return self._inner

    def _lose(self, exc: BaseException, during: str) -> None:
        """Note the loss once and start rebuilding in the background."""
        with self._lock:
            if self._lost_at is not None:
                return
            self._lost_at = time.monotonic()
        self._log.warning(
            "rdzv.store_lost",
            endpoint=self._endpoint,
            during=during,
            error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
        )
        self._reconnector = threading.Thread(
            target=self._reconnect, name="rdzv-reconnect", daemon=True
        )
        self._reconnector.start()

    def _reconnect(self) -> None:
        while not self._closing.is_set():
            try:
                fresh = self._make()  # connects, or fails after the backend's read timeout
            except Exception:  # not back yet (torch wraps the store's errors in its own)
                self._closing.wait(self._retry_every_s)
                continue
            with self._lock:
                self._inner, lost_at, self._lost_at = fresh, self._lost_at, None
            self._log.info(
                "rdzv.store_back",
                endpoint=self._endpoint,
                outage_s=round(time.monotonic() - (lost_at or time.monotonic()), 3),
            )
            return

    def _wait_back(self) -> RendezvousHandler:
        deadline = time.monotonic() + self._join_timeout_s
        while self.lost and time.monotonic() < deadline:
            t = self._reconnector
            if t is not None:
                t.join(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        if self.lost:
            raise RendezvousConnectionError(
                f"the rendezvous store at {self._endpoint} did not come back within "
                f"{self._join_timeout_s:g} s (the join timeout)"
            )
        return self._current()

    # the calls the agent makes
    def next_rendezvous(self) -> RendezvousInfo:
        deadline = time.monotonic() + self._join_timeout_s
        while True:
            inner = self._wait_back()
            try:
                return inner.next_rendezvous()
            except Exception as e:
                if not _store_trouble(e) or time.monotonic() > deadline:
                    raise
                self._lose(e, "next_rendezvous")

    def num_nodes_waiting(self) -> int:
        if self.lost:
            return 0  # the running round goes on; a waiting node is seen once it is back
        try:
            return self._current().num_nodes_waiting()
        except Exception as e:
            if not _store_trouble(e):
                raise
            self._lose(e, "num_nodes_waiting")
            return 0

    def is_closed(self) -> bool:
        return False if self.lost else self._current().is_closed()

    def set_closed(self) -> None:
        self._current().set_closed()

    def shutdown(self) -> bool:
        self._closing.set()
        if self.lost:
            return False
        return self._current().shutdown()
