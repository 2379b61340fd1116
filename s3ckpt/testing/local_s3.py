"""An embedded S3 server (SeaweedFS ``weed mini``) for tests, demos and laptops.

Tests and the demo need a real S3 endpoint that speaks multipart uploads, conditional
writes and checksums, without network access or a shared bucket. ``weed mini`` runs a
whole SeaweedFS cluster (master, volume, filer, S3 gateway) in one process and starts in
about a second, so each test session gets its own private server.

Isolation rules, so that two servers (two pytest sessions, a test and a CLI) coexist:

* every listening port is chosen free at start and passed explicitly; front ends we do
  not need (WebDAV, admin UI, Iceberg, Lance, telemetry) are switched off;
* everything binds to 127.0.0.1 only;
* data, logs and the credentials file live in a fresh temporary directory;
* credentials are random per server, so a stray client cannot hit the wrong one.

``tls=True`` also serves S3 over HTTPS on a second port, with a CA and a certificate for
``localhost`` generated at start (:mod:`s3ckpt.testing.tls_cert`): :attr:`https_endpoint_url`
and :attr:`ca_file` are what a client needs; the plain HTTP endpoint stays, so the two can
be compared against one server.

``weed`` hard-codes one unix socket per gRPC port as ``/tmp/seaweedfs-<svc>-<port>.sock``;
:meth:`LocalS3Server.stop` removes any it left behind for the ports this server owned.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from s3ckpt.errors import ConfigError, LocalServerError
from s3ckpt.testing.tls_cert import TLS_HOST, TlsFiles, write_tls_files
from s3ckpt.testing.weed import (
    INSTALL_HINT,
    PORT_FLAGS,
    WEED_ENV,
    command,
    die_with_parent,
    find_weed,
    free_ports,
    kill_group,
)

__all__ = ["DEFAULT_BUCKET", "INSTALL_HINT", "WEED_ENV", "LocalS3Server", "find_weed"]

DEFAULT_BUCKET = "s3ckpt"
REGION = "us-east-1"

_START_ATTEMPTS = 3  # a port picked free can be taken before weed binds it: retry with new ones


class LocalS3Server:
    """A private SeaweedFS S3 endpoint on 127.0.0.1; a context manager.

    ``buckets`` is one name or several; all are created at start, ``bucket`` is the first.
    ``data_dir`` keeps data across runs (it is created if missing and never deleted);
    without it a temporary directory is used and removed by :meth:`stop`.
    """

    def __init__(
        self,
        buckets: str | Sequence[str] = DEFAULT_BUCKET,
        *,
        data_dir: str | os.PathLike[str] | None = None,
        weed_path: str | os.PathLike[str] | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        tls: bool = False,
    ) -> None:
        self.buckets: tuple[str, ...] = (buckets,) if isinstance(buckets, str) else tuple(buckets)
        if not self.buckets:
            raise ConfigError("LocalS3Server needs at least one bucket name")
        self.region = REGION
        self.access_key = "S3CKPT" + secrets.token_hex(7).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self.ports: dict[str, int] = {}
        self.startup_seconds: float | None = None
        self._user_dir = Path(data_dir) if data_dir is not None else None
        self._weed_path = weed_path
        self._startup_timeout = startup_timeout
        self._stop_timeout = stop_timeout
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.tls = tls
        self.tls_files: TlsFiles | None = None

    # -- public attributes -------------------------------------------------------------

    @property
    def bucket(self) -> str:
        return self.buckets[0]

    @property
    def endpoint_url(self) -> str:
        if "s3.port" not in self.ports:
            raise LocalServerError("the local S3 server has not been started")
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def https_endpoint_url(self) -> str:
        """The HTTPS endpoint (``tls=True``): ``https://localhost:<port>``, which the
        generated certificate names."""
        if not self.tls or "s3.port.https" not in self.ports:
            raise LocalServerError("the local S3 server was not started with tls=True")
        return f"https://{TLS_HOST}:{self.ports['s3.port.https']}"

    @property
    def ca_file(self) -> Path:
        """The generated CA certificate that the HTTPS endpoint's certificate chains to."""
        if self.tls_files is None:
            raise LocalServerError("the local S3 server was not started with tls=True")
        return self.tls_files.ca_file

    @property
    def data_dir(self) -> Path | None:
        return self._dir

    @property
    def log_path(self) -> Path | None:
        return self._dir / "weed.log" if self._dir else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self) -> Any:
        """A boto3 S3 client for this server: path-style addressing, SigV4."""
        return self._client(connect_timeout=5, read_timeout=60, retries=5)

    def env(self) -> dict[str, str]:
        """The ``AWS_*`` variables that point boto3, the AWS CLI and s3ckpt at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server log, for error messages."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        with self.log_path.open(errors="replace") as f:
            return "".join(deque(f, maxlen=lines)).rstrip() or "(empty log)"

    def __repr__(self) -> str:  # never shows the secret key
        where = self.endpoint_url if self.ports else "not started"
        return (
            f"LocalS3Server({where}, buckets={list(self.buckets)}, "
            f"access_key={self.access_key!r}, pid={self.pid}, running={self.running})"
        )

    def __enter__(self) -> LocalS3Server:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> LocalS3Server:
        """Spawn ``weed mini``, wait until S3 answers, create the buckets."""
        if self._proc is not None:
            raise LocalServerError(f"{self!r} was already started")
        weed = find_weed(self._weed_path)
        t0 = time.monotonic()
        self._dir = self._make_dir()
        atexit.register(self.stop)
        try:
            if self.tls:
                self.tls_files = write_tls_files(self._dir)
            for attempt in range(_START_ATTEMPTS):
                self._spawn(weed)
                if self._wait_ready(
                    t0 + self._startup_timeout, last=attempt + 1 == _START_ATTEMPTS
                ):
                    break
            self._create_buckets(t0 + self._startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Terminate the process group, then delete sockets and the temporary data dir.

        Idempotent, and registered with :mod:`atexit` so that an interpreter exit never
        leaves a server running.
        """
        atexit.unregister(self.stop)
        self._kill()
        if self._dir is not None and self._user_dir is None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _make_dir(self) -> Path:
        if self._user_dir is None:
            return Path(tempfile.mkdtemp(prefix="s3ckpt-local-s3-"))
        try:
            self._user_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LocalServerError(
                f"cannot use {self._user_dir} as the data directory: {exc.strerror}"
            ) from exc
        return self._user_dir.resolve()

    def _spawn(self, weed: str) -> None:
        assert self._dir is not None and self.log_path is not None
        self._kill()
        self.ports = free_ports(PORT_FLAGS + (("s3.port.https",) if self.tls else ()))
        identities = self._dir / "s3-identities.json"
        identity = {
            "name": "s3ckpt-local",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        identities.write_text(json.dumps({"identities": [identity]}))
        identities.chmod(0o600)
        args = command(weed, self._dir, identities, self.ports, self.tls_files)
        with self.log_path.open("ab") as log:
            log.write(f"\n--- s3ckpt: starting {' '.join(args)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
                start_new_session=True,  # its own process group, killed as a whole in stop()
                preexec_fn=die_with_parent(),
            )

    def _wait_ready(self, deadline: float, *, last: bool) -> bool:
        """Poll ListBuckets until it succeeds; False means "port clash, spawn again"."""
        client = self._client(connect_timeout=0.5, read_timeout=2, retries=1)
        assert self._proc is not None
        error: BaseException | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                if not last and "address already in use" in self.log_tail(60).lower():
                    return False
                raise LocalServerError(
                    f"SeaweedFS exited with status {self._proc.returncode} during startup; "
                    f"weed log tail:\n{self.log_tail()}"
                )
            try:
                client.list_buckets()
                return True
            except Exception as exc:  # not listening yet, or S3 not wired to the filer yet
                error = exc
            time.sleep(0.05)
        raise LocalServerError(
            f"SeaweedFS S3 did not answer within {self._startup_timeout:.0f}s "
            f"(last error: {error}); weed log tail:\n{self.log_tail()}"
        )

    def _create_buckets(self, deadline: float) -> None:
        client = self._client(connect_timeout=1, read_timeout=5, retries=1)
        for name in self.buckets:
            while True:
                try:
                    client.create_bucket(Bucket=name)
                    break
                except Exception as exc:
                    response = getattr(exc, "response", None) or {}
                    code = response.get("Error", {}).get("Code")
                    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                    if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        break
                    # A 4xx (bad name...) will not heal by itself; only 5xx/network is retried.
                    if 400 <= status < 500 or time.monotonic() >= deadline:
                        raise LocalServerError(
                            f"could not create bucket {name!r} on local S3: {exc}; "
                            f"weed log tail:\n{self.log_tail()}"
                        ) from exc
                    time.sleep(0.1)

    def _kill(self) -> None:
        """Stop the process group and remove the unix sockets of its ports."""
        proc, self._proc = self._proc, None
        if proc is not None:
            kill_group(proc, self._stop_timeout, self.ports, self._dir)

    def _client(self, *, connect_timeout: float, read_timeout: float, retries: int) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                retries={"max_attempts": retries, "mode": "standard"},
            ),
        )
