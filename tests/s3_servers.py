"""The S3 servers the suite runs against: SeaweedFS and moto's server, both on 127.0.0.1.

SeaweedFS is :class:`s3ckpt.testing.local_s3.LocalS3Server`; moto's server is
:class:`MotoS3Server` here, with the same surface as far as the tests use it. It differs
from SeaweedFS where real stores differ (docs/compatibility.md): no CRC32C check on parts,
no composite checksums, MaxUploads ignored. A test module runs against both with
``pytestmark = [ON_BOTH]`` (the ``local_s3`` fixture, parametrized).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SERVERS = ["seaweedfs_s3", "moto_s3"]  # fixture names (tests/conftest.py)
ON_BOTH = pytest.mark.parametrize("local_s3", SERVERS, indirect=True, ids=["seaweedfs", "moto"])


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A loopback port kept from everyone but a server that binds it with SO_REUSEADDR
    (werkzeug's, so moto's, does), until the block ends.

    The socket stays bound, with SO_REUSEADDR and without listening: the kernel gives the
    port to no other ``bind`` to port 0 and to no outgoing connection, so a server that
    takes seconds to start cannot find it taken (by a second test run's servers, say), and
    whatever answers on it is that server. Until one does, a connection to it is refused:
    an endpoint nothing can come to answer on, for the tests of one that is unreachable.
    """
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        yield int(holder.getsockname()[1])


class MotoS3Server:
    """``moto_server`` in a child process with one bucket; a context manager."""

    region = "us-east-1"

    def __init__(self, bucket: str = "s3ckpt") -> None:
        self.bucket = bucket
        self.access_key = "MOTO" + secrets.token_hex(8).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> MotoS3Server:
        executable = shutil.which("moto_server", path=str(Path(sys.executable).parent))
        command = [executable] if executable else [sys.executable, "-m", "moto.server"]
        with held_port() as self.port:  # until moto listens on it, and nobody else can
            self.process = subprocess.Popen(
                [*command, "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={**os.environ, "MOTO_S3_CUSTOM_ENDPOINTS": self.endpoint_url},
            )
            try:
                self._wait_ready()
            except BaseException:
                self.stop()
                raise
        try:
            self.client().create_bucket(Bucket=self.bucket)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.process.returncode}")
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError("moto_server did not start")

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}),
        )

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }
