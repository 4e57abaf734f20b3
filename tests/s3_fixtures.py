"""Fixtures for S3 tests over real HTTP on 127.0.0.1: moto's server and the fault proxy.

Import the fixtures into a test module (`from s3_fixtures import ...`). Every S3 test gets
AWS_ENDPOINT_URL pointing at loopback, fake credentials and a region through monkeypatch,
with the user's AWS config files and the instance-metadata lookup switched off, so nothing
can reach a public endpoint.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import s3fs

from chaos.s3proxy import S3FaultProxy

# Distinctive fake credentials: tests grep for them in every log, event and error message.
ACCESS_KEY = "AKIDRESILIENTFAKE7Q2"
SECRET_KEY = "resilientFakeSecret/Zx81kQwpR2v9LmN0"
SESSION_TOKEN = "resilientFakeSessionToken4UvW3xYz"
SECRETS = (ACCESS_KEY, SECRET_KEY, SESSION_TOKEN)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """moto's S3 server in this process, on a free loopback port, for the whole session."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@dataclass
class S3Env:
    """A fresh bucket on the moto server, and the environment that points clients at it."""

    endpoint: str
    bucket: str
    fs: Any  # an s3fs filesystem for inspecting the bucket from the test
    secrets: tuple[str, ...] = SECRETS

    def url(self, prefix: str = "ckpt") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def objects(self, prefix: str = "") -> list[str]:
        """Every object key under `prefix` (relative to the bucket), sorted."""
        root = f"{self.bucket}/{prefix}".rstrip("/")
        try:
            found = self.fs.find(root)
        except FileNotFoundError:
            return []
        return sorted(k[len(self.bucket) + 1 :] for k in found)

    def open_uploads(self) -> list[dict[str, Any]]:
        """Multipart uploads started and neither completed nor aborted."""
        out = self.fs.call_s3("list_multipart_uploads", Bucket=self.bucket)
        return list(out.get("Uploads", []))


def point_aws_env_at(monkeypatch: pytest.MonkeyPatch, endpoint: str, home: Path) -> None:
    """AWS_* variables for a loopback endpoint with fake credentials; no config files."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION_TOKEN)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "no-aws-credentials"))
    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_ROLE_ARN"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def s3(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3Env:
    """A new bucket on moto; AWS_* variables point every client at it."""
    point_aws_env_at(monkeypatch, moto_endpoint, tmp_path)
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
    fs.mkdir(bucket)
    return S3Env(endpoint=moto_endpoint, bucket=bucket, fs=fs)


@pytest.fixture
def s3proxy(s3: S3Env, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3FaultProxy]:
    """The fault proxy in front of moto; AWS_ENDPOINT_URL points at the proxy."""
    proxy = S3FaultProxy(s3.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.start())
    yield proxy
    proxy.stop()
