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
    """One connection (plain or TLS) to an origin, used by one thread at a time: blocking
    in a worker thread, non-blocking on the event loop (``setblocking``).

    TLS on the loop runs on memory BIOs over the raw socket: ciphertext moves in large
    socket calls (:data:`CIPHER_CHUNK`), and OpenSSL decrypts into the caller's memory.
    An ``SSLSocket`` reads every 16 KiB record with two system calls of its own; on the
    loop that cost 0.85-0.91 client CPU-s/GiB for ranged GETs, against 0.75-0.82 for
    uvloop's TLS transport, which also decrypts from memory. TLS in worker threads (upload
    bodies) is an ``SSLSocket``, whose ``sendall`` encrypts straight into the kernel's
    buffer: through the BIOs (the ciphertext copied once more) a save cost 1.18-1.21x
    the client CPU on the zero-cost server.
    """

    def __init__(
        self, sock: socket.socket, origin: Origin, tls: ssl.SSLObject | None = None
    ) -> None:
        self.sock = sock
        self.origin = origin
        self.blocking_tls = isinstance(sock, ssl.SSLSocket)  # for worker threads only
        self.endpoint = f"{origin[0]}://{origin[1]}:{origin[2]}"
        self.session = tls
        self.tls = tls is not None or self.blocking_tls
        self.used = False  # carried a request before (a failure may just mean it went stale)
        self.closed = False
        self.timed_out = False  # stopped by the stall timer
        self.progress = time.monotonic()  # when a byte last moved
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._cipher = memoryview(bytearray(CIPHER_CHUNK)) if tls is not None else None
        self._unsent = b""  # ciphertext the non-blocking socket did not take yet
        self._raw_drained = False  # the last non-blocking socket read came back short

    @classmethod
    def over_tls(
        cls, sock: socket.socket, origin: Origin, context: ssl.SSLContext, *, blocking: bool
    ) -> Connection:
        """A TLS connection, its handshake done on the (blocking) socket: an ``SSLSocket``
        for worker threads (``blocking``), whose ``sendall`` encrypts a body straight into
        the kernel's buffer, else TLS on memory BIOs for the event loop."""
        if blocking:
            return cls(context.wrap_socket(sock, server_hostname=origin[1]), origin)
        connection = cls(sock, origin)
        session = context.wrap_bio(
            connection._incoming, connection._outgoing, server_hostname=origin[1]
        )  # SNI and host name check
        connection.session, connection.tls = session, True
        connection._cipher = memoryview(bytearray(CIPHER_CHUNK))
        while True:
            try:
                session.do_handshake()
                break
            except ssl.SSLWantReadError:
                connection._send_outgoing()
                if not connection._take_ciphertext():
                    raise ConnectionResetError("closed during the TLS handshake") from None
        connection._send_outgoing()
        return connection

    # -- blocking (worker threads) --------------------------------------------------------

    def send_all(self, data: bytes | memoryview) -> None:
        """Send all of ``data`` (blocking mode)."""
        if self.session is None:
            self.sock.sendall(data)
            return
        view = memoryview(data)
        for start in range(0, len(view), CIPHER_CHUNK):
            self.session.write(view[start : start + CIPHER_CHUNK])
            self._send_outgoing()

    def recv_into(self, view: memoryview, *, whole: bool = False) -> int:
        """Receive into ``view`` (blocking mode); 0 at the end of the stream. ``whole``:
        until ``view`` is full or the stream ends."""
        if self.blocking_tls:
            return self._recv_records(view, whole)
        if self.session is None:
            return self.sock.recv_into(view, len(view), socket.MSG_WAITALL if whole else 0)
        done = 0
        while done < len(view):
            count = self._decrypt(view[done:])
            if count is None:  # nothing decrypted is waiting
                if done and not whole:
                    break
                if not self._take_ciphertext():
                    self._incoming.write_eof()
            elif count == 0:
                break
            else:
                done += count
                if not whole:
                    break
        return done

    # -- non-blocking (the event loop) ----------------------------------------------------

    def recv_ready(self, view: memoryview) -> int:
        """Receive what is there into ``view`` (non-blocking mode): its length, 0 at the
        end of the stream, :data:`DRAINED` once the socket has nothing more for now.

        A socket read that came back short means the socket is empty: the next call says
        so without the system call (and the exception) that would find out, once per
        wake-up of the reader; the loop's level-triggered readiness calls again when
        more arrives."""
        if self.session is None:
            if self._raw_drained:
                self._raw_drained = False
                return DRAINED
            count = self.sock.recv_into(view)
            self._raw_drained = 0 < count < len(view)
            return count
        while True:
            count = self._decrypt(view)
            if count is not None:
                return count
            if self._raw_drained:
                self._raw_drained = False
                return DRAINED
            received = self._take_ciphertext()  # BlockingIOError when nothing came
            if not received:
                self._incoming.write_eof()
            self._raw_drained = 0 < received < CIPHER_CHUNK

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

    def _recv_records(self, view: memoryview, whole: bool) -> int:
        """An ``SSLSocket``'s receive: one record per call."""
        done = 0
        while done < len(view):
            try:
                count = self.sock.recv_into(view[done:])
            except ssl.SSLZeroReturnError:
                count = 0
            done += count
            if not count or not whole:
                break
        return done

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
            if self.sock.getblocking():
                self._send_outgoing()
            else:
                self.send_ready(b"")
        return count

    def _take_ciphertext(self) -> int:
        """Receive ciphertext into the incoming BIO; 0 at the end of the stream."""
        assert self._cipher is not None
        count = self.sock.recv_into(self._cipher)
        if count:
            self._incoming.write(self._cipher[:count])
        return count

    def _send_outgoing(self) -> None:
        data = self._outgoing.read()
        if data:
            self.sock.sendall(data)


# Ciphertext moved per socket call, and plaintext encrypted per call of OpenSSL's write.
CIPHER_CHUNK = 256 * 1024
DRAINED = -1  # recv_ready: nothing more to read for now


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
        blocking = origin[0] == "https"
        return self._idle_connection(origin, blocking) or self._connect(origin, blocking=blocking)

    async def checkout(self, origin: Origin) -> Connection:
        """An idle connection to ``origin``, or a new one (connected in a worker thread),
        in non-blocking mode for the event loop (call on the loop)."""
        connection = self._idle_connection(origin, False)
        if connection is None:
            loop = asyncio.get_running_loop()
            connect = functools.partial(self._connect, origin, blocking=False)
            connection = await loop.run_in_executor(self.executor, connect)
        connection.sock.setblocking(False)
        connection.progress = time.monotonic()
        connection._raw_drained = False
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
        scheme, host, port = origin
        endpoint = f"{scheme}://{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=self.connect_timeout)
        except TimeoutError as exc:
            raise connect_timeout(endpoint) from exc
        except OSError as exc:
            raise connection_failed(endpoint, exc) from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if scheme == "https":
                connection = Connection.over_tls(
                    sock, origin, self._tls_context(), blocking=blocking
                )
            else:
                connection = Connection(sock, origin)
        except ssl.SSLError as exc:
            sock.close()
            raise tls_failed(endpoint, exc) from exc
        except TimeoutError as exc:
            sock.close()
            raise connect_timeout(endpoint) from exc
        except OSError as exc:
            sock.close()
            raise connection_failed(endpoint, exc) from exc
        connection.sock.settimeout(None)  # stalls are the loop timer's (the module docstring)
        return connection

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
            connection.sock.setblocking(True)  # a worker thread's
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
        watch = StallTimer(loop, lambda: attempt.connection, self.read_timeout, abort_stalled)
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


def abort_stalled(connection: Connection) -> None:
    """A blocking exchange that stalled: its call ends, and it raises the read timeout."""
    connection.timed_out = True
    connection.abort()
