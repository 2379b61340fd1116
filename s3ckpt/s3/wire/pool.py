"""Kept-alive connections to an endpoint, and the worker threads that drive TLS uploads.

Every data-plane request (an upload body, a ranged GET) is an asyncio task under the
client's request bound. Most run on the event loop, on non-blocking connections; an
upload over TLS runs in a thread of a pool as large as that bound, on a blocking
``SSLSocket``, so OpenSSL encrypts its body into the kernel in a few large calls that
release the GIL (:mod:`s3ckpt.s3.wire` has the figures).

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
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from s3ckpt.s3.wire.connection import Connection, Origin, StaleConnection, open_connection
from s3ckpt.s3.wire.exchange import send_request
from s3ckpt.s3.wire.stall import StallTimer, abort_stalled
from s3ckpt.s3.wire.tls import tls_context

T = TypeVar("T")


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
        # Idle connections by origin and by whether they are blocking TLS sockets (which
        # only worker threads use).
        self._idle: dict[tuple[Origin, bool], list[Connection]] = {}
        self._lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None
        self._shut = False  # closed: connections are no longer kept alive

    async def send_in_thread(
        self, origin: Origin, head: bytes, body: memoryview
    ) -> tuple[int, dict[str, str], bytes]:
        """Send ``head`` and ``body`` on a blocking TLS connection to ``origin`` in a
        worker thread (:func:`~.exchange.send_request`): the answer's status, headers and
        (small) body. A stale kept-alive connection is replaced and the request sent
        again."""
        while True:
            attempt = _Attempt()
            call = functools.partial(self._send, origin, head, body, attempt)
            try:
                return await self._in_thread(attempt, call)
            except StaleConnection:
                continue

    def lease(self, origin: Origin) -> Lease:
        """A connection to ``origin`` for one exchange on the loop, as ``async with``
        gives it: released for the next request where the exchange set the lease's
        ``keep_alive``, closed otherwise (a failure included). An exchange that finds its
        kept-alive connection stale raises :class:`StaleConnection`, and its caller goes
        again on a fresh lease."""
        return Lease(self, origin)

    def connection(self, origin: Origin) -> Connection:
        """An idle blocking TLS connection to ``origin``, or a new one (call in a worker
        thread). Worker threads run TLS exchanges only: plain HTTP runs on the loop."""
        if origin[0] != "https":
            raise ValueError(f"no worker-thread exchange over {origin[0]}: it runs on the loop")
        return self._idle_connection(origin, True) or self._connect(origin, blocking=True)

    async def checkout(self, origin: Origin) -> Connection:
        """An idle connection to ``origin``, or a new one (connected in a worker thread),
        in non-blocking mode for the event loop (call on the loop)."""
        connection = self._idle_connection(origin, False)
        if connection is None:
            loop = asyncio.get_running_loop()
            connect = functools.partial(self._connect, origin, blocking=False)
            opening = loop.run_in_executor(self.executor, connect)
            try:
                connection = await asyncio.shield(opening)
            except asyncio.CancelledError:  # the connection it opens is closed, unused
                opening.add_done_callback(_close_unused)
                raise
        if connection.sock.gettimeout() != 0.0:  # setblocking is a system call (and a GIL release)
            connection.sock.setblocking(False)
        connection.progress = time.monotonic()
        connection.raw_drained = False
        return connection

    def _idle_connection(self, origin: Origin, blocking: bool) -> Connection | None:
        while True:
            with self._lock:
                idle = self._idle.get((origin, blocking))
                connection = idle.pop() if idle else None
            if connection is None or connection.idle_and_sound():
                return connection
            connection.close()

    def release(self, connection: Connection, *, keep_alive: bool) -> None:
        """Keep a connection whose response ended cleanly for the next request; close others."""
        connection.used = True
        if keep_alive and not connection.closed:
            with self._lock:
                idle = self._idle.setdefault((connection.origin, connection.blocking_tls), [])
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

    def _connect(self, origin: Origin, *, blocking: bool) -> Connection:
        return open_connection(
            origin, timeout=self.connect_timeout, tls=self._tls_context, blocking=blocking
        )

    def _tls_context(self) -> ssl.SSLContext:
        with self._lock:
            if self._tls is None:
                self._tls = tls_context(self.verify)
            return self._tls

    def _send(
        self, origin: Origin, head: bytes, body: memoryview, attempt: _Attempt
    ) -> tuple[int, dict[str, str], bytes]:
        connection = attempt.hold(self.connection(origin))
        try:
            if connection.sock.gettimeout() is not None:
                connection.sock.setblocking(True)  # a worker thread's
            answer, keep_alive = send_request(connection, head, body)
        except BaseException:
            connection.close()
            raise
        self.release(connection, keep_alive=keep_alive)
        return answer

    async def _in_thread(self, attempt: _Attempt, call: Callable[[], T]) -> T:
        """``call()`` in a worker thread, watched for stalls; on cancellation its connection
        is shut down (or, not yet connected, closed as soon as it is) and the thread
        awaited before the cancellation goes on."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.executor, call)
        watch = StallTimer(loop, lambda: attempt.connection, self.read_timeout, abort_stalled)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            attempt.cancel()
            while not future.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([future])
            if not future.cancelled():
                future.exception()  # what the cut-off call ended with is nobody's to report
            raise
        finally:
            watch.stop()


class Lease:
    """One exchange's connection (:meth:`ConnectionPool.lease`): ``connection`` once
    entered; ``keep_alive``, set by the exchange, says whether it may serve the next."""

    def __init__(self, pool: ConnectionPool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.keep_alive = False
        self.connection: Connection

    async def __aenter__(self) -> Lease:
        self.connection = await self.pool.checkout(self.origin)
        return self

    async def __aexit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.pool.release(self.connection, keep_alive=self.keep_alive)
        else:
            self.connection.close()


def _close_unused(opening: asyncio.Future[Connection]) -> None:
    """Close the connection a cancelled checkout opened (its failure, if it failed, is
    nobody's to report)."""
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


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
