"""The zero-cost S3 endpoint (``benchmarks/zero_s3.c``): built, started and measured here.

A real S3 server on the same two cores takes most of the CPU a benchmark has: SeaweedFS
spends several CPU-seconds per GiB it stores, so clients that differ by a fraction of a
CPU-second per GiB are hard to tell apart on it. This server keeps objects in memory,
checks no signatures, and costs one kernel copy per byte in each direction, so what is
measured is the client. It is compiled on first use with the machine's C compiler
(``cc``, or ``$CC``) into ``build/zero_s3/`` (one binary per source version) and listens
on 127.0.0.1 only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().parent / "zero_s3.c"
BUILD = Path(__file__).resolve().parents[1] / "build" / "zero_s3"
BUCKET = "bench"
REGION = "us-east-1"


def compiler() -> str | None:
    """The C compiler to build the server with, or None where there is none."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build() -> Path:
    """The server binary for the current source, compiled if not cached yet: with HTTPS
    where OpenSSL's headers and libraries are there, without it otherwise."""
    tool = compiler()
    if tool is None:
        raise RuntimeError("no C compiler (cc) to build the zero-cost S3 server")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    binary = BUILD / f"zero_s3-{digest}"
    if not binary.exists():
        BUILD.mkdir(parents=True, exist_ok=True)
        partial = binary.with_suffix(f".{os.getpid()}.tmp")
        base = [tool, "-O2", "-pthread", "-o", str(partial), str(SOURCE)]
        tls = subprocess.run([*base, "-DZERO_S3_TLS", "-lssl", "-lcrypto"], capture_output=True)
        if tls.returncode != 0:
            subprocess.run(base, check=True)
        partial.replace(binary)  # atomic: two builds at once leave one good binary
    return binary


class ZeroS3:
    """The server as a context manager: ``endpoint_url``, ``env()`` for client processes,
    ``client()`` (boto3) and ``cpu_seconds()``, the server process's CPU time so far."""

    def __init__(self, pool_mib: int = 0, *, tls: bool = False) -> None:
        self.pool_mib = pool_mib  # memory mapped and touched for bodies before it listens
        self.tls = tls  # also serve HTTPS (a CA and a localhost certificate made at start)
        self.process: subprocess.Popen[str] | None = None
        self.port = 0
        self.tls_port = 0
        self.bucket = BUCKET
        self._tls_dir: tempfile.TemporaryDirectory[str] | None = None
        self.ca_file = ""

    def __enter__(self) -> ZeroS3:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        env = {**os.environ, "ZERO_S3_POOL_MIB": str(self.pool_mib)}
        if self.tls:
            from s3ckpt.testing.tls_cert import write_tls_files

            self._tls_dir = tempfile.TemporaryDirectory(prefix="zero-s3-tls-")
            files = write_tls_files(Path(self._tls_dir.name))
            self.ca_file = str(files.ca_file)
            env |= {
                "ZERO_S3_TLS_CERT": str(files.cert_file),
                "ZERO_S3_TLS_KEY": str(files.key_file),
            }
        self.process = subprocess.Popen(
            [str(build())], stdout=subprocess.PIPE, text=True, start_new_session=True, env=env
        )
        line = self.process.stdout.readline() if self.process.stdout else ""
        if self.tls and line.startswith("TLSPORT "):
            self.tls_port = int(line.split()[1])
            line = self.process.stdout.readline() if self.process.stdout else ""
        elif self.tls:
            self.stop()
            raise RuntimeError("the zero-cost S3 server was built without OpenSSL: no HTTPS")
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"zero-cost S3 server did not start: {line!r}")
        self.port = int(line.split()[1])
        self.client().create_bucket(Bucket=self.bucket)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None
        if self._tls_dir is not None:
            self._tls_dir.cleanup()
            self._tls_dir = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def https_endpoint_url(self) -> str:
        return f"https://localhost:{self.tls_port}"

    def env(self) -> dict[str, str]:
        """What a client process needs: endpoint, region, and credentials nobody checks."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": "zero",
            "AWS_SECRET_ACCESS_KEY": "zero-secret",
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "S3_ENDPOINT_URL": self.endpoint_url,  # s5cmd's name for it
        }

    def options(self) -> dict[str, str]:
        """What an s3ckpt writer or reader in this process needs (``S3Config``'s names)."""
        return {
            "endpoint_url": self.endpoint_url,
            "access_key_id": "zero",
            "secret_access_key": "zero-secret",
            "region": REGION,
        }

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id="zero",
            aws_secret_access_key="zero-secret",
            region_name=REGION,
            config=Config(s3={"addressing_style": "path"}),
        )

    def cpu_seconds(self) -> float:
        """User plus system CPU time of the server process (all its threads)."""
        if self.process is None:
            return 0.0
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks


if __name__ == "__main__":  # run it by hand: python -m benchmarks.zero_server
    with ZeroS3() as server:
        print(server.endpoint_url, flush=True)
        try:
            server.process.wait() if server.process else None
        except KeyboardInterrupt:
            sys.exit(0)
