"""HTTPS upload bodies sent by blocking ``ssl.SSLSocket.sendall`` in worker threads.

Measured on the embedded SeaweedFS over TLS (loopback, 2 cores shared with the server):
through aiohttp and the event loop's TLS transport a save cost 1.2-1.3 client CPU-s/GiB
against 0.4-0.45 over plain HTTP. The difference is how bytes reach OpenSSL: the
transport encrypts through memory BIOs into new ``bytes`` objects and runs Python for
each, so the zero-copy send of plain HTTP (:mod:`s3ckpt.s3.http_body`) is lost. A blocking
``SSLSocket`` gives it back: ``sendall`` hands the tensor's memory to ``SSL_write``, which
encrypts it record by record straight into the kernel's socket buffer with the GIL
released; a save then costs 0.7 CPU-s/GiB, about plain HTTP plus AES-256-GCM itself
(0.2 s/GiB at OpenSSL's 5 GB/s per core here). Ranged GETs stay on the event loop
(:mod:`s3ckpt.s3.http_range` says why: there, the loop's transport is the cheaper one).

The event loop stays the scheduler: each request is still an asyncio task under the
client's request bound; only the blocking exchange on its connection runs in a thread of
a pool as large as that bound. Connections are kept alive per endpoint and reused one
request at a time. Cancelling a request shuts its socket down, which ends the blocking
call at once, and waits for the thread, so no byte is read from memory after the caller
has moved on. Verification is what aiobotocore does with the same ``verify`` value:
certificate chain and host name, a custom CA file, SNI (:func:`s3ckpt.s3.http_range.tls_context`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import ssl
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from s3ckpt.s3.compat_botocore import (
    connect_timeout,
    connection_failed,
    tls_failed,
)

T = TypeVar("T")


class TlsConnection:
    """One blocking TLS connection to ``host:port``, used by one thread at a time."""

    def __init__(self, sock: ssl.SSLSocket, host: str, port: int) -> None:
        self.sock = sock
        self.origin = (host, port)
        self.endpoint = f"https://{host}:{port}"
        self.used = False  # carried a request before (a failure may just mean it went stale)
        self.closed = False

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


class TlsTransport:
    """Kept-alive TLS connections to one endpoint and the threads that drive them."""

    def __init__(
        self,
        context: ssl.SSLContext,
        *,
        connect_timeout: float,
        read_timeout: float,
        max_idle: int,
    ) -> None:
        self.context = context
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle
        self.executor = ThreadPoolExecutor(max_idle, thread_name_prefix="s3ckpt-tls")
        self._idle: dict[tuple[str, int], list[TlsConnection]] = {}
        self._lock = threading.Lock()
        self._shut = False  # closed: connections are no longer kept alive

    def connection(self, host: str, port: int) -> TlsConnection:
        """An idle connection to ``host:port``, or a new one (call in a worker thread)."""
        with self._lock:
            idle = self._idle.get((host, port))
            if idle:
                return idle.pop()
        return self._connect(host, port)

    def _connect(self, host: str, port: int) -> TlsConnection:
        endpoint = f"https://{host}:{port}"
        try:
            raw = socket.create_connection((host, port), timeout=self.connect_timeout)
        except TimeoutError as exc:
            raise connect_timeout(endpoint) from exc
        except OSError as exc:
            raise connection_failed(endpoint, exc) from exc
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock = self.context.wrap_socket(raw, server_hostname=host)  # SNI and host check
        except ssl.SSLError as exc:
            raw.close()
            raise tls_failed(endpoint, exc) from exc
        except TimeoutError as exc:
            raw.close()
            raise connect_timeout(endpoint) from exc
        except OSError as exc:
            raw.close()
            raise connection_failed(endpoint, exc) from exc
        sock.settimeout(self.read_timeout)  # a receive silent this long fails the request
        return TlsConnection(sock, host, port)

    def release(self, connection: TlsConnection, *, keep_alive: bool) -> None:
        """Keep a connection whose response ended cleanly for the next request; close others."""
        connection.used = True
        if keep_alive and not connection.closed:
            with self._lock:
                idle = self._idle.setdefault(connection.origin, [])
                if not self._shut and len(idle) < self.max_idle:
                    idle.append(connection)
                    return
        connection.close()

    def close_idle(self) -> None:
        """Close the kept-alive connections (those in use close when their request ends)."""
        with self._lock:
            idle = [c for conns in self._idle.values() for c in conns]
            self._idle.clear()
        for connection in idle:
            connection.close()

    async def aclose(self) -> None:
        """Close every kept-alive connection; a request still running closes its own when
        it ends, since nothing is kept alive after this."""
        with self._lock:
            self._shut = True
        self.close_idle()
        self.executor.shutdown(wait=False)

    async def run(
        self, host: str, port: int, exchange: Callable[[TlsConnection], tuple[T, bool]]
    ) -> T:
        """Run ``exchange`` (blocking; returns its result and whether the connection may be
        kept) on a connection to ``host:port`` in a worker thread. A kept-alive connection
        that the server had closed meanwhile is replaced without counting as a failure
        (only reused connections can be stale, and each is tried once)."""
        while True:
            attempt = _Attempt()
            try:
                return await self._in_thread(
                    attempt, functools.partial(self._exchange, host, port, exchange, attempt)
                )
            except StaleConnection:
                continue

    def _exchange(
        self,
        host: str,
        port: int,
        exchange: Callable[[TlsConnection], tuple[T, bool]],
        attempt: _Attempt,
    ) -> T:
        connection = attempt.hold(self.connection(host, port))
        try:
            result, keep_alive = exchange(connection)
        except BaseException:
            connection.close()
            raise
        self.release(connection, keep_alive=keep_alive)
        return result

    async def _in_thread(self, attempt: _Attempt, call: Callable[[], T]) -> T:
        """``call()`` in a worker thread; on cancellation its connection is shut down (or,
        not yet connected, closed as soon as it is) and the thread awaited before the
        cancellation goes on, so no byte is sent from memory the caller has let go of."""
        future = asyncio.get_running_loop().run_in_executor(self.executor, call)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            attempt.cancel()
            while not future.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([future])
            raise


class _Attempt:
    """The connection one request runs on, and whether the request was cancelled."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connection: TlsConnection | None = None
        self._cancelled = False

    def hold(self, connection: TlsConnection) -> TlsConnection:
        """Record the connection (worker thread); aborted at once if already cancelled."""
        with self._lock:
            self._connection = connection
            if self._cancelled:
                connection.abort()
        return connection

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._connection is not None:
                self._connection.abort()


class StaleConnection(Exception):
    """A kept-alive connection closed before any byte of the response arrived."""
