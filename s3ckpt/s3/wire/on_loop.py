"""Exchanges on the event loop: waits for a socket's readiness, whole sends, and a plain
HTTP upload's request and answer; :class:`BodyTransport`, which sends a request head and
a body from memory here over plain HTTP, and in a worker thread of the pool over TLS.

Plain-HTTP upload bodies are sent from the loop thread: a non-blocking ``send`` of the
body's memory hands the kernel as much as its socket buffer takes, a few calls per part,
with no thread hand-over and no GIL contention, where worker threads would take the GIL
back against the loop after every call; over TLS the threads are cheaper, because
encryption runs with the GIL released (:mod:`s3ckpt.s3.wire.uploads`;
docs/decisions/0004-tls-path.md).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from s3ckpt.s3.compat_botocore import read_timeout
from s3ckpt.s3.wire.connection import DRAINED, Connection, Origin, StaleConnection
from s3ckpt.s3.wire.exchange import (
    MAX_HEADER_BYTES,
    SmallResponse,
    answered,
    failure,
    is_head,
)
from s3ckpt.s3.wire.pool import ConnectionPool
from s3ckpt.s3.wire.stall import StallTimer, abort_stalled

_DEFAULT_PORTS = {"http": 80, "https": 443}


class BodyTransport:
    """Sends a request head and a body from memory on the pool's connections."""

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool

    async def send(
        self, url: Any, head: bytes, body: memoryview
    ) -> tuple[int, dict[str, str], bytes]:
        """The status, headers and (small) body of the answer to ``head`` + ``body``."""
        origin = (url.scheme, url.hostname, url.port or _DEFAULT_PORTS[url.scheme])
        if url.scheme == "https":  # encrypted in a worker thread, the GIL released
            return await self.pool.send_in_thread(origin, head, body)
        return await send_request(self.pool, origin, head, body)


async def send_request(
    pool: ConnectionPool, origin: Origin, head: bytes, body: memoryview
) -> tuple[int, dict[str, str], bytes]:
    """Send a request with ``body`` on a connection to ``origin`` (non-blocking, on the
    loop); the response's status, headers and (small) body. A stale kept-alive
    connection is replaced and the request sent again."""
    while True:
        try:
            async with pool.lease(origin) as lease:
                response = await _exchange(lease.connection, head, body, pool.read_timeout)
                lease.keep_alive = response.keep_alive
            return response.result()
        except StaleConnection:
            continue


async def _exchange(
    connection: Connection, head: bytes, body: memoryview, timeout: float
) -> SmallResponse:
    loop = asyncio.get_running_loop()
    reused, connection.used = connection.used, True
    watch = StallTimer(loop, lambda: connection, timeout, abort_stalled)
    try:
        try:
            await send_all(connection, head)
            await send_all(connection, body)
        except OSError as exc:
            error = failure(connection, exc, reused=reused, received=False)
            # The server may have answered (an error) and closed before taking the whole
            # body: that answer is the one worth reporting.
            if isinstance(error, StaleConnection) or not answered(connection):
                raise error from exc
        return await _response(connection, reused, to_head=is_head(head))
    finally:
        watch.stop()


async def _response(connection: Connection, reused: bool, *, to_head: bool) -> SmallResponse:
    response = SmallResponse(to_head=to_head)
    scratch = memoryview(bytearray(MAX_HEADER_BYTES))
    received = False
    while True:
        try:
            count = await receive_some(connection, scratch)
        except OSError as exc:
            raise failure(connection, exc, reused=reused, received=received) from exc
        if connection.timed_out:
            raise read_timeout(connection.endpoint)
        if not count and reused and not received:
            raise StaleConnection
        received = received or count > 0
        if response.feed(bytes(scratch[:count])):
            return response
        if not count:
            raise ConnectionResetError("the connection closed before a whole response")


async def send_all(connection: Connection, data: bytes | memoryview) -> None:
    """Send all of ``data`` on the non-blocking connection, waiting while its socket is
    full: the one send of every exchange on the loop. Plain TCP sends straight from
    ``data``'s memory (an upload body is never copied); TLS on memory BIOs encrypts it and
    sends the ciphertext as the socket takes it (:meth:`Connection.send_ready`)."""
    if connection.session is not None:
        pending = bytes(data)
        while not connection.send_ready(pending):
            pending = b""
            await ready(connection, writable=True)
        connection.progress = time.monotonic()
        return
    view = memoryview(data)
    sent = 0
    while sent < len(view):
        try:
            sent += connection.sock.send(view[sent:])
        except BlockingIOError:
            await ready(connection, writable=True)
            continue
        connection.progress = time.monotonic()


async def receive_some(connection: Connection, view: memoryview) -> int:
    """Receive what arrives next into ``view``, waiting until something does; 0 at the
    end of the stream."""
    while True:
        try:
            count = connection.recv_ready(view)
        except BlockingIOError:
            count = DRAINED
        if count != DRAINED:
            if count:
                connection.progress = time.monotonic()
            return count
        await ready(connection, writable=False)


async def ready(connection: Connection, *, writable: bool) -> None:
    """Wait until the socket can be written to (or read from). A socket the stall timer
    shut down is ready at once, and the next call on it fails."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    fd = connection.sock.fileno()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    (loop.add_writer if writable else loop.add_reader)(fd, wake)
    try:
        await waiter
    finally:
        (loop.remove_writer if writable else loop.remove_reader)(fd)
