"""A fault-injecting HTTP proxy for an S3-protocol server (moto's server mode in the tests).

Point a client's endpoint at `S3FaultProxy(upstream).start()` and add faults; requests that no
fault matches are forwarded unchanged. Faults:

- `slowdown`: 503 SlowDown with S3's XML error body (what S3 says when throttling).
- `internal`: 500 InternalError.
- `forbidden`: 403 AccessDenied (a permanent error: must not be retried).
- `reset`: the connection is reset (TCP RST) before any response.
- `reset_after`: the request is forwarded and done upstream, then the connection is reset:
  the client cannot tell that it took effect.
- `delay`: the response is held `delay_s` seconds (longer than the client's read timeout
  makes it a timeout).

A fault matches by method and a regex over the path with its query, skips the first `after`
matches and fires `times` times (None: for ever). Everything seen is kept in `log`.

    proxy = S3FaultProxy("http://127.0.0.1:5000")
    url = proxy.start()
    proxy.add("slowdown", method="PUT", path=r"partNumber=", times=3)
    ...
    proxy.stop()

Signatures: SigV4 covers the Host header, which is forwarded as the client sent it, so a
server that checks signatures accepts proxied requests.
"""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["FAULTS", "Fault", "S3FaultProxy", "Seen"]

FAULTS = ("slowdown", "internal", "forbidden", "reset", "reset_after", "delay")
_ERRORS = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "internal": (500, "InternalError", "We encountered an internal error. Please try again."),
    "forbidden": (403, "AccessDenied", "Access Denied"),
}
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
}


@dataclass
class Fault:
    kind: str
    method: str | None = None
    path: str | None = None
    after: int = 0
    times: int | None = 1
    delay_s: float = 0.0
    matched: int = 0
    fired: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULTS:
            raise ValueError(f"unknown fault {self.kind!r}; one of {FAULTS}")
        self._regex = re.compile(self.path) if self.path else None

    def take(self, method: str, target: str) -> bool:
        """Whether this request gets the fault (counts it). Called under the proxy's lock."""
        if self.method and method != self.method:
            return False
        if self._regex and not self._regex.search(target):
            return False
        self.matched += 1
        if self.matched <= self.after:
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        self.fired += 1
        return True


@dataclass(frozen=True)
class Seen:
    method: str
    target: str
    fault: str | None
    status: int | None
    at: float = field(default_factory=time.monotonic)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the log is in `seen`
        pass

    def do_GET(self) -> None:
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _handle(self) -> None:
        body = self._read_body()
        proxy = self.server.proxy
        fault = proxy._pick(self.command, self.path)
        kind = fault.kind if fault else None
        if kind is not None:  # recorded now: a delayed client may be gone by the reply
            proxy._record(self.command, self.path, kind, _ERRORS.get(kind, (None,))[0])
        if kind in _ERRORS:
            status, code, message = _ERRORS[kind]
            self._respond_error(status, code, message)
            return
        if kind == "reset":
            self._reset()
            return
        if kind == "delay":
            assert fault is not None
            time.sleep(fault.delay_s)
        try:
            status, headers, payload = proxy._forward(self.command, self.path, self.headers, body)
        except OSError:
            proxy._record(self.command, self.path, "upstream_error", None)
            self._reset()
            return
        if kind is None:
            proxy._record(self.command, self.path, None, status)
        if kind == "reset_after":
            self._reset()
            return
        with contextlib.suppress(OSError):  # the client may have timed out and left
            self.send_response(status)
            for k, v in headers:
                if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            length = dict((k.lower(), v) for k, v in headers).get("content-length")
            if self.command == "HEAD" and length is not None:
                self.send_header("Content-Length", length)
            else:
                self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
            self.wfile.flush()

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _respond_error(self, status: int, code: str, message: str) -> None:
        payload = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            "<RequestId>resilient-chaos</RequestId></Error>"
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)
        self.wfile.flush()

    def _reset(self) -> None:
        """Close with SO_LINGER 0: the client sees a connection reset, not a clean close."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        for f in (self.rfile, self.wfile):
            with contextlib.suppress(OSError, ValueError):
                f.close()
        with contextlib.suppress(OSError):
            self.connection.close()

    def handle_one_request(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # after a reset the files are closed
            super().handle_one_request()

    def finish(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            super().finish()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: S3FaultProxy


class S3FaultProxy:
    """A threaded HTTP proxy on 127.0.0.1 (a free port) in front of `upstream`."""

    def __init__(self, upstream: str, *, upstream_timeout_s: float = 60.0) -> None:
        u = urllib.parse.urlsplit(upstream)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self._upstream = (u.hostname, u.port or 80)
        self._timeout = upstream_timeout_s
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self.seen: list[Seen] = []
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        port = self._server.server_address[1]
        return f"http://127.0.0.1:{port}"

    def start(self) -> str:
        """Listen on a free loopback port; returns the proxy's URL."""
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="s3-fault-proxy", daemon=True
        )
        self._thread.start()
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> S3FaultProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ schedule
    def add(
        self,
        kind: str,
        *,
        method: str | None = None,
        path: str | None = None,
        after: int = 0,
        times: int | None = 1,
        delay_s: float = 0.0,
    ) -> Fault:
        """Schedule a fault (see the module docstring); returns it, to read its counters."""
        fault = Fault(kind, method=method, path=path, after=after, times=times, delay_s=delay_s)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        """Remove every fault; requests pass unchanged from now on."""
        with self._lock:
            self._faults.clear()

    def injected(self, kind: str | None = None) -> int:
        """How many requests got a fault (of `kind`)."""
        with self._lock:
            return sum(1 for s in self.seen if s.fault and (kind is None or s.fault == kind))

    # ------------------------------------------------------------------ internals
    def _pick(self, method: str, target: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.take(method, target):
                    return fault
        return None

    def _record(self, method: str, target: str, fault: str | None, status: int | None) -> None:
        with self._lock:
            self.seen.append(Seen(method, target, fault, status))

    def _forward(
        self, method: str, target: str, headers: Any, body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        # One upstream connection per request: a retried keep-alive send could apply a
        # request twice, which is exactly what the faults must control.
        conn = http.client.HTTPConnection(*self._upstream, timeout=self._timeout)
        try:
            out = {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}
            out.pop("Expect", None)
            out["Content-Length"] = str(len(body))
            conn.request(method, target, body=body, headers=out)
            resp = conn.getresponse()
            return resp.status, list(resp.getheaders()), resp.read()
        finally:
            conn.close()
