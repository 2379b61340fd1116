"""Kept-alive connections to an endpoint, and the worker threads that drive uploads.

Every data-plane request (an upload body, a ranged GET) is an asyncio task under the
client's request bound. An upload's exchange runs in a thread of a pool as large as that
bound, on the connection in blocking mode, so its body goes to the kernel (through
OpenSSL, over TLS) in a few large calls that release the GIL; a ranged GET runs on the
event loop, on the same kind of connection in non-blocking mode
(:mod:`s3ckpt.s3.wire` has the figures).

One policy for every connection, plain or TLS:

* **keep-alive**: a connection whose response ended cleanly goes back to the idle list of
  its origin (at most ``max_idle`` per origin), and is reused one request at a time;
* **stale connections**: an idle connection the server has closed (or that has bytes
  nobody asked for) is dropped when taken; one that fails before any byte of its
  response arrives raises :class:`StaleConnection` and the request goes again on a fresh
  connection, without counting as a failure (only reused connections can be stale, and
  each is tried once);
* **timeouts**: ``connect_timeout`` for the TCP connect and the TLS handshake; a request
  whose connection moves no byte for ``read_timeout`` is stopped by a timer on the event
  loop and fails with botocore's ``ReadTimeoutError`` (sockets carry no timeout of their
  own: with one, every blocking TLS record read would poll first);
* **cancellation**: cancelling a request shuts its socket down, which ends the blocking
  call at once, and waits for the thread, so no byte is read from or written to memory
  after the caller has moved on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from s3ckpt.s3.compat_botocore import connect_timeout, connection_failed, tls_failed
from s3ckpt.s3.wire.tls import tls_context

T = TypeVar("T")
Origin = tuple[str, str, int]  # scheme, host, port


class StaleConnection(Exception):
    """A kept-alive connection closed before any byte of the response arrived."""


class Connection:
    """One blocking connection (plain or TLS) to an origin, used by one thread at a time."""

    def __init__(self, sock: socket.socket, origin: Origin) -> None:
        self.sock = sock
        self.origin = origin
        self.endpoint = f"{origin[0]}://{origin[1]}:{origin[2]}"
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.used = False  # carried a request before (a failure may just mean it went stale)
        self.closed = False
        self.timed_out = False  # aborted by the stall timer
        self.progress = time.monotonic()  # when a byte last moved

    def idle_and_sound(self) -> bool:
        """Whether a kept-alive connection can take a request: nothing is waiting on it
        (an end of stream, or bytes nobody asked for, mean it cannot)."""
        if self.closed:
            return False
        try:
            if self.tls and self.sock.pending():  # type: ignore[attr-defined]
                return False
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


class ConnectionPool:
    """Kept-alive connections per origin, and the threads that drive them."""

    def __init__(
        self,
        *,
        verify: bool | str,
        connect_timeout: float,
        read_timeout: float,
        max_idle: int,
    ) -> None:
        self.verify = verify
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle
        self.executor = ThreadPoolExecutor(max_idle, thread_name_prefix="s3ckpt-wire")
        self._idle: dict[Origin, list[Connection]] = {}
        self._lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None
        self._shut = False  # closed: connections are no longer kept alive

    async def run(self, origin: Origin, exchange: Callable[[Connection], tuple[T, bool]]) -> T:
        """Run ``exchange`` (blocking; returns its result and whether the connection may be
        kept) on a connection to ``origin`` in a worker thread, replacing stale ones."""
        while True:
            attempt = _Attempt()
            call = functools.partial(self._exchange, origin, exchange, attempt)
            try:
                return await self._in_thread(attempt, call)
            except StaleConnection:
                continue

    def connection(self, origin: Origin) -> Connection:
        """An idle connection to ``origin``, or a new one (call in a worker thread)."""
        return self._idle_connection(origin) or self._connect(origin)

    async def checkout(self, origin: Origin) -> Connection:
        """An idle connection to ``origin``, or a new one (connected in a worker thread),
        in non-blocking mode for the event loop (call on the loop)."""
        connection = self._idle_connection(origin)
        if connection is None:
            loop = asyncio.get_running_loop()
            connection = await loop.run_in_executor(self.executor, self._connect, origin)
        connection.sock.setblocking(False)
        connection.progress = time.monotonic()
        return connection

    def _idle_connection(self, origin: Origin) -> Connection | None:
        while True:
            with self._lock:
                idle = self._idle.get(origin)
                connection = idle.pop() if idle else None
            if connection is None or connection.idle_and_sound():
                return connection
            connection.close()

    def release(self, connection: Connection, *, keep_alive: bool) -> None:
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

    def _connect(self, origin: Origin) -> Connection:
        scheme, host, port = origin
        endpoint = f"{scheme}://{host}:{port}"
        try:
            raw = socket.create_connection((host, port), timeout=self.connect_timeout)
        except TimeoutError as exc:
            raise connect_timeout(endpoint) from exc
        except OSError as exc:
            raise connection_failed(endpoint, exc) from exc
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock = raw
            if scheme == "https":
                sock = self._tls_context().wrap_socket(raw, server_hostname=host)  # SNI, host check
        except ssl.SSLError as exc:
            raw.close()
            raise tls_failed(endpoint, exc) from exc
        except TimeoutError as exc:
            raw.close()
            raise connect_timeout(endpoint) from exc
        except OSError as exc:
            raw.close()
            raise connection_failed(endpoint, exc) from exc
        sock.settimeout(None)  # stalls are the loop's timer's to catch (see the module docstring)
        return Connection(sock, origin)

    def _tls_context(self) -> ssl.SSLContext:
        with self._lock:
            if self._tls is None:
                self._tls = tls_context(self.verify)
            return self._tls

    def _exchange(
        self, origin: Origin, exchange: Callable[[Connection], tuple[T, bool]], attempt: _Attempt
    ) -> T:
        connection = attempt.hold(self.connection(origin))
        try:
            connection.sock.setblocking(True)
            result, keep_alive = exchange(connection)
        except BaseException:
            connection.close()
            raise
        self.release(connection, keep_alive=keep_alive)
        return result

    async def _in_thread(self, attempt: _Attempt, call: Callable[[], T]) -> T:
        """``call()`` in a worker thread, watched for stalls; on cancellation its connection
        is shut down (or, not yet connected, closed as soon as it is) and the thread
        awaited before the cancellation goes on."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.executor, call)
        watch = StallTimer(loop, lambda: attempt.connection, self.read_timeout, _abort_stalled)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            attempt.cancel()
            while not future.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([future])
            raise
        finally:
            watch.stop()


class _Attempt:
    """The connection one request runs on, and whether the request was cancelled."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.connection: Connection | None = None
        self._cancelled = False

    def hold(self, connection: Connection) -> Connection:
        """Record the connection (worker thread); aborted at once if already cancelled."""
        connection.progress = time.monotonic()
        with self._lock:
            self.connection = connection
            if self._cancelled:
                connection.abort()
        return connection

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self.connection is not None:
                self.connection.abort()


class StallTimer:
    """Calls ``on_stall(connection)`` once no byte has moved on the watched connection for
    ``timeout`` seconds. ``watched()`` is the connection, or None while there is none yet
    (connecting is not watched: it has its own timeout)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        watched: Callable[[], Connection | None],
        timeout: float,
        on_stall: Callable[[Connection], None],
    ) -> None:
        self.loop = loop
        self.watched = watched
        self.timeout = timeout
        self.on_stall = on_stall
        self.handle: asyncio.TimerHandle | None = loop.call_later(timeout, self._check)

    def _check(self) -> None:
        connection = self.watched()
        now = time.monotonic()
        if connection is not None and now - connection.progress >= self.timeout:
            self.handle = None
            self.on_stall(connection)
            return
        since = now - connection.progress if connection is not None else 0.0
        self.handle = self.loop.call_later(max(self.timeout - since, 0.01), self._check)

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


def _abort_stalled(connection: Connection) -> None:
    """A blocking exchange that stalled: its call ends, and it raises the read timeout."""
    connection.timed_out = True
    connection.abort()
