"""One connection to an origin: opened, used blocking or non-blocking, closed.

A connection is used by one thread at a time: blocking in a worker thread (TLS upload
bodies), non-blocking on the event loop (everything else; ``setblocking`` switches). The
two kinds of TLS differ because what is cheap differs:

* on the loop, TLS runs on memory BIOs over the raw socket: ciphertext moves in large
  socket calls (:data:`CIPHER_CHUNK`), and OpenSSL decrypts into the caller's memory,
  where a non-blocking ``SSLSocket`` would read every 16 KiB record with two system
  calls of its own;
* in worker threads, TLS is a blocking ``SSLSocket``, whose ``sendall`` encrypts a body
  straight into the kernel's buffer with the GIL released, where the BIOs would copy the
  ciphertext once more.

Both choices are the cheaper of the two in client CPU (docs/decisions/0004-tls-path.md).
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import time
from collections.abc import Callable

from s3ckpt.s3.compat_botocore import (
    connect_timeout,
    connection_failed,
    read_timeout,
    tls_failed,
)

Origin = tuple[str, str, int]  # scheme, host, port
# Ciphertext moved per socket call on the loop's TLS connections.
CIPHER_CHUNK = 256 * 1024
DRAINED = -1  # recv_ready: nothing more to read for now


class StaleConnection(Exception):
    """A kept-alive connection closed before any byte of the response arrived."""


class Connection:
    """One connection (plain TCP, a blocking ``SSLSocket``, or TLS on memory BIOs)."""

    def __init__(
        self,
        sock: socket.socket,
        origin: Origin,
        session: ssl.SSLObject | None = None,
        bios: tuple[ssl.MemoryBIO, ssl.MemoryBIO] | None = None,
    ) -> None:
        self.sock = sock
        self.origin = origin
        self.endpoint = f"{origin[0]}://{origin[1]}:{origin[2]}"
        self.session = session  # TLS on memory BIOs (the loop's)
        self.blocking_tls = isinstance(sock, ssl.SSLSocket)  # worker threads' TLS
        self.used = False  # carried a request before (a failure may just mean it went stale)
        self.closed = False
        self.timed_out = False  # stopped by the stall timer
        self.progress = time.monotonic()  # when a byte last moved
        self._incoming, self._outgoing = bios or (ssl.MemoryBIO(), ssl.MemoryBIO())
        self._cipher = memoryview(bytearray(CIPHER_CHUNK)) if session is not None else None
        self._unsent = b""  # ciphertext the non-blocking socket did not take yet
        self.raw_drained = False  # the last non-blocking socket read came back short

    # -- blocking (worker threads: TLS) --------------------------------------------------

    def send_all(self, data: bytes | memoryview) -> None:
        """Send all of ``data`` (blocking mode, an ``SSLSocket``)."""
        self.sock.sendall(data)

    def recv_into(self, view: memoryview) -> int:
        """Receive into ``view`` (blocking mode, an ``SSLSocket``); 0 at the end of the stream."""
        try:
            return self.sock.recv_into(view)
        except ssl.SSLZeroReturnError:
            return 0

    # -- non-blocking (the event loop) ----------------------------------------------------

    def recv_ready(self, view: memoryview) -> int:
        """Receive what is there into ``view`` (non-blocking mode): its length, 0 at the
        end of the stream, :data:`DRAINED` once the socket has nothing more for now.

        A socket read that came back short means the socket is empty: the next call says
        so without the system call (and the exception) that would find out, once per
        wake-up of the reader; the loop's level-triggered readiness calls again when
        more arrives (docs/decisions/0004-tls-path.md)."""
        if self.session is None:
            if self.raw_drained:
                self.raw_drained = False
                return DRAINED
            count = self.sock.recv_into(view)
            self.raw_drained = 0 < count < len(view)
            return count
        while True:
            count = self._decrypt(view)
            if count is not None:
                return count
            if self.raw_drained:
                self.raw_drained = False
                return DRAINED
            received = self._take_ciphertext()  # BlockingIOError when nothing came
            if not received:
                self._incoming.write_eof()
            self.raw_drained = 0 < received < CIPHER_CHUNK

    def send_ready(self, data: bytes) -> bool:
        """Queue ``data`` and send what the socket takes now (non-blocking mode); whether
        everything queued has gone (else call again once writable, with ``b""``)."""
        if self.session is not None:
            if data:
                self.session.write(data)
            data = self._outgoing.read()
        self._unsent += data
        while self._unsent:
            try:
                sent = self.sock.send(self._unsent)
            except BlockingIOError:
                return False
            self._unsent = self._unsent[sent:]
        return True

    # -- both -----------------------------------------------------------------------------

    def idle_and_sound(self) -> bool:
        """Whether a kept-alive connection can take a request: nothing is waiting on it
        (an end of stream, or bytes nobody asked for, mean it cannot)."""
        if self.closed or self._unsent:
            return False
        if self.session is not None and (self.session.pending() or self._incoming.pending):
            return False
        if self.blocking_tls and self.sock.pending():  # type: ignore[attr-defined]
            return False
        try:
            poller = select.poll()  # not select.select: file numbers past 1024 are fine
            poller.register(self.sock, select.POLLIN)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False

    def abort(self) -> None:
        """Stop any blocking call on this connection now (from any thread)."""
        self.closed = True
        with contextlib.suppress(OSError):
            # socket.socket's shutdown, not SSLSocket's, which would drop the SSL object
            # from under a thread still reading.
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()

    def _decrypt(self, view: memoryview) -> int | None:
        """Plaintext already received, into ``view``: its length, 0 at the end of the
        stream, None when more ciphertext is needed."""
        assert self.session is not None
        try:
            count = self.session.read(len(view), view)
        except ssl.SSLWantReadError:
            count = None
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            count = 0
        if self._outgoing.pending:  # a TLS message of its own to send back (a key update)
            self.send_ready(b"")
        return count

    def _take_ciphertext(self) -> int:
        """Receive ciphertext into the incoming BIO; 0 at the end of the stream."""
        assert self._cipher is not None
        count = self.sock.recv_into(self._cipher)
        if count:
            self._incoming.write(self._cipher[:count])
        return count

    def _handshake(self) -> None:
        """The TLS handshake on memory BIOs, over the (still blocking) raw socket."""
        assert self.session is not None
        while True:
            try:
                self.session.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.sock.sendall(self._outgoing.read())
                if not self._take_ciphertext():
                    raise ConnectionResetError("closed during the TLS handshake") from None
        self.sock.sendall(self._outgoing.read())


def open_connection(
    origin: Origin,
    *,
    timeout: float,
    tls: Callable[[], ssl.SSLContext],
    blocking: bool,
) -> Connection:
    """Connect to ``origin`` (blocking; call in a worker thread) and, over HTTPS, shake
    hands: a blocking ``SSLSocket`` for worker threads (``blocking``), else TLS on memory
    BIOs for the loop. Errors are the ones botocore raises for the same failures; a
    handshake the endpoint accepted the connection for and then left unanswered is a
    read timeout (silence, as :mod:`s3ckpt.s3.retry` counts stalls), not a connect one."""
    scheme, host, port = origin
    endpoint = f"{scheme}://{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError as exc:
        raise connect_timeout(endpoint) from exc
    except OSError as exc:
        raise connection_failed(endpoint, exc) from exc
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        connection = _secured(sock, origin, tls, blocking) if scheme == "https" else None
        connection = connection or Connection(sock, origin)
    except ssl.SSLError as exc:
        sock.close()
        raise tls_failed(endpoint, exc) from exc
    except TimeoutError as exc:  # connected, then silent: a stalled endpoint, as a read
        sock.close()
        raise read_timeout(endpoint) from exc
    except OSError as exc:
        sock.close()
        raise connection_failed(endpoint, exc) from exc
    connection.sock.settimeout(None)  # stalls are the stall timer's (s3ckpt.s3.wire.pool)
    return connection


def _secured(
    sock: socket.socket, origin: Origin, tls: Callable[[], ssl.SSLContext], blocking: bool
) -> Connection:
    context = tls()
    if blocking:  # SNI and host name check, as below
        return Connection(context.wrap_socket(sock, server_hostname=origin[1]), origin)
    bios = (ssl.MemoryBIO(), ssl.MemoryBIO())
    session = context.wrap_bio(*bios, server_hostname=origin[1])
    connection = Connection(sock, origin, session, bios)
    connection._handshake()
    return connection
