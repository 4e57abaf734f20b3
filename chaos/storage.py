"""Storage for chaos runs: an S3 server with a fault proxy on loopback, and a small disk.

`LoopbackS3` starts moto's S3 server on 127.0.0.1 and the fault proxy (chaos/s3proxy.py) in
front of it; runs get `env` (AWS_ENDPOINT_URL pointing at the proxy, fake credentials, no
config files, no instance metadata), so no request can leave the machine.

`SmallDisk` mounts a tmpfs of a few MiB on the checkpoint directory (root only) and can fill
it to the last byte and free it again: a real ENOSPC for the writer, not a mock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

from chaos.s3proxy import S3FaultProxy

__all__ = ["LoopbackS3", "SmallDisk", "small_disk_unavailable"]


class LoopbackS3:
    """moto's S3 server behind the fault proxy, and a fresh bucket."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.bucket = f"chaos-{uuid.uuid4().hex[:10]}"
        self.proxy: S3FaultProxy | None = None
        self.env: dict[str, str] = {}
        self._upstream = ""

    def url(self, prefix: str = "ckpt") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def filesystem(self) -> Any:
        """An s3fs filesystem on the server itself (no proxy, no listing cache)."""
        import s3fs

        return s3fs.S3FileSystem(
            key="x",
            secret="x",
            endpoint_url=self._upstream,
            client_kwargs={"region_name": "us-east-1"},
            skip_instance_cache=True,
            use_listings_cache=False,
        )

    def __enter__(self) -> LoopbackS3:
        self._server.start()
        host, port = self._server.get_host_and_port()
        self._upstream = f"http://{host}:{port}"
        self.proxy = S3FaultProxy(self._upstream)
        endpoint = self.proxy.start()
        self.env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "AKIDCHAOSFAKE0000000",
            "AWS_SECRET_ACCESS_KEY": "chaosFakeSecret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
        import boto3

        boto3.client(
            "s3",
            endpoint_url=f"http://{host}:{port}",
            aws_access_key_id="x",
            aws_secret_access_key="x",
            region_name="us-east-1",
        ).create_bucket(Bucket=self.bucket)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self._server.stop()


def small_disk_unavailable() -> str | None:
    """Why a tmpfs cannot be mounted here, or None."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    probe = Path(f"/tmp/chaos-tmpfs-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            return f"mount -t tmpfs failed: {done.stderr.strip() or done.returncode}"
        subprocess.run(["umount", str(probe)], capture_output=True, check=False)
        return None
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


class SmallDisk:
    """A tmpfs of `size_mib` mounted on `path` for the duration of a `with` block."""

    def __init__(self, path: Path, size_mib: int = 48) -> None:
        self.path = path
        self.size_mib = size_mib
        self._filler = path / ".chaos-filler"

    def __enter__(self) -> SmallDisk:
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size_mib}m", "tmpfs", str(self.path)],
            check=True,
            capture_output=True,
        )
        return self

    def fill(self) -> int:
        """Take every free byte, growing the filler file; returns how many it took now. In
        pieces: one fallocate of all the free space fails whole, taking nothing, when a save
        writes meanwhile (soak 2026, run 0199: the disk never filled, no save failed). Call it
        again to take what a deletion freed since."""
        fd = os.open(self._filler, os.O_CREAT | os.O_WRONLY, 0o600)
        took, piece = 0, 1 << 20
        try:
            size = os.fstat(fd).st_size
            while piece >= 4096:
                try:
                    os.posix_fallocate(fd, size, piece)
                except OSError:  # ENOSPC: smaller pieces for what is left
                    piece //= 16
                    continue
                size += piece
                took += piece
        finally:
            os.close(fd)
        return took

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._filler.unlink()

    def __exit__(self, *exc: object) -> None:
        # lazy unmount: a process that still holds a file there must not keep it mounted
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)

    def info(self) -> dict[str, Any]:
        st = os.statvfs(self.path)
        return {"size_mib": self.size_mib, "free_bytes": st.f_bavail * st.f_frsize}
