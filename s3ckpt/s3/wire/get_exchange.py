"""One ranged GET on one connection, on the event loop, its body received into a sink.

The expected answer, a ``206`` whose ``Content-Range`` and ``Content-Length`` match the
range asked for, is received straight into the memory the sink names: a reader callback
on the loop calls the non-blocking socket's ``recv_into`` with that memory, so each byte
is copied once, by the kernel (plain TCP) or by OpenSSL as it decrypts (TLS). Reads stay
on the loop thread because over TLS OpenSSL hands over one 16 KiB record per call, and in
worker threads each call's release and re-take of the GIL would contend with the other
requests' threads (docs/decisions/0004-tls-path.md). Error responses become the botocore
``ClientError`` aiobotocore would raise; a successful response that cannot be received in
place (chunked, no length, a redirect) raises :class:`UnsupportedResponse`, and the caller
hands the request to aiobotocore. A server that ignores ``Range`` and sends the whole
object has the range cut from it (and the connection closed once it is in).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import xml.etree.ElementTree as ElementTree

from botocore.exceptions import ClientError

from s3ckpt.s3.compat_botocore import read_timeout
from s3ckpt.s3.retry import ShortReadError
from s3ckpt.s3.wire.connection import Connection, Origin, StaleConnection
from s3ckpt.s3.wire.exchange import MAX_HEADER_BYTES, SmallResponse, failure
from s3ckpt.s3.wire.on_loop import send_all
from s3ckpt.s3.wire.pool import ConnectionPool
from s3ckpt.s3.wire.sink import RangeSink, copy_into
from s3ckpt.s3.wire.stall import StallTimer

log = logging.getLogger(__name__)

# Largest single receive: big enough that a call moves a lot, small enough that the
# bytes are still in cache when the sink checksums them right after.
MAX_RECEIVE = 1024 * 1024


class UnsupportedResponse(Exception):
    """A successful response this reader cannot receive in place; use aiobotocore instead."""


async def receive_range(
    pool: ConnectionPool, origin: Origin, request: bytes, start: int, end: int, sink: RangeSink
) -> None:
    """Send the GET ``request`` for ``[start, end)`` on a connection to ``origin`` and
    receive its body into ``sink``; raises the ``ClientError`` the server answered
    instead. A kept-alive connection the server had closed is replaced silently."""
    while True:
        error: ClientError | None = None
        try:
            async with pool.lease(origin) as lease:
                response = _RangeResponse(lease.connection, start, end, sink, pool.read_timeout)
                try:
                    await response.run(request)
                except ClientError as answer:  # an error answer, its body read whole: kept alive
                    error = answer
                lease.keep_alive = response.keep_alive
        except StaleConnection:
            continue
        if error is not None:
            raise error
        return


class _RangeResponse:
    """One response, read by a reader callback on the event loop: the head (and any body
    but the expected one) through h11, then the expected body straight into the sink,
    up to :data:`MAX_RECEIVE` bytes per call of ``sink.filled``."""

    def __init__(
        self, connection: Connection, start: int, end: int, sink: RangeSink, read_timeout: float
    ) -> None:
        self.connection = connection
        self.loop = asyncio.get_running_loop()
        self.start = start
        self.end = end
        self.sink = sink
        self.read_timeout = read_timeout
        self.future: asyncio.Future[None] = self.loop.create_future()
        self.answer = SmallResponse(body_in_place=True)  # the head, or an error and its body
        self.scratch = memoryview(bytearray(MAX_HEADER_BYTES))
        self.received = False  # any byte of a response arrived
        self.reused = False  # the connection carried a request before (it may be stale)
        self.in_body = False  # the expected body is being received into the sink
        self.keep_alive = True
        self.position = start  # next body byte expected
        self.skip = 0  # body bytes before the range, from a server that ignored Range
        self.piece: memoryview | None = None  # the sink memory being filled
        self.piece_filled = 0

    async def run(self, request: bytes) -> None:
        """Send ``request`` and receive its response; a failure is read by the data
        plane's one policy (:func:`~s3ckpt.s3.wire.exchange.failure`)."""
        connection = self.connection
        self.reused, connection.used = connection.used, True
        fd = connection.sock.fileno()
        watch = StallTimer(self.loop, lambda: connection, self.read_timeout, self._stalled)
        try:
            await self._send(request)
            self.loop.add_reader(fd, self._readable)
            try:
                self._readable()  # bytes (TLS records) may already be waiting
                await self.future
            finally:
                self.loop.remove_reader(fd)
        finally:
            watch.stop()

    async def _send(self, data: bytes) -> None:
        """Write the (small) request on the non-blocking connection."""
        try:
            await send_all(self.connection, data)
        except OSError as exc:
            raise failure(self.connection, exc, reused=self.reused, received=False) from exc

    # -- the reader callback ------------------------------------------------------------

    def _readable(self) -> None:
        """Read everything the socket has (over TLS, record by record) until it would block;
        the body's loop is kept short, as it runs once per 16 KiB record over TLS."""
        connection = self.connection
        received = 0
        try:
            while not self.future.done():
                if self.in_body:
                    piece = self.piece if self.piece is not None else self._next_piece()
                    count = connection.recv_ready(piece[self.piece_filled :])
                    if count > 0:
                        received += count
                        self.piece_filled += count
                        if self.piece_filled == len(piece):
                            self._flush()
                        continue
                else:
                    count = connection.recv_ready(self._head_buffer())
                    if count > 0:
                        received += count
                        self.received = True
                        self._data(count)
                        continue
                self._flush()
                if count == 0:
                    self._closed()
                return
        except (BlockingIOError, InterruptedError):
            self._flush()
        except OSError as exc:
            got = self.received or received > 0
            self._fail(failure(connection, exc, reused=self.reused, received=got))
        finally:
            if received:
                self.received = True
                connection.progress = time.monotonic()

    def _next_piece(self) -> memoryview:
        """The sink's memory for the next bytes, at most :data:`MAX_RECEIVE` of them."""
        view = self.sink.buffer(self.position)
        self.piece = view[: min(len(view), self.end - self.position, MAX_RECEIVE)]
        self.piece_filled = 0
        return self.piece

    def _head_buffer(self) -> memoryview:
        if self.skip:
            return self.scratch[: min(self.skip, len(self.scratch))]
        return self.scratch

    def _data(self, count: int) -> None:
        if self.skip:
            self.skip -= count
            if not self.skip:
                self._start_body()
        else:
            self._parse(bytes(self.scratch[:count]))

    def _flush(self) -> None:
        """Hand the bytes received into the current piece to the sink."""
        if self.piece is None or not self.piece_filled:
            return
        filled, self.piece, self.piece_filled = self.piece_filled, None, 0
        self.sink.filled(self.position, filled)
        self.position += filled
        if self.position == self.end:
            self._finish()

    def _closed(self) -> None:
        """The server closed the connection: ends a close-delimited body, or the response."""
        if self.connection.timed_out:
            self._fail(read_timeout(self.connection.endpoint))
        elif self.in_body or self.skip:
            self._fail(
                ShortReadError(
                    f"the connection closed after {self.position - self.start} "
                    f"bytes of a {self.end - self.start}-byte range"
                )
            )
        elif self.reused and not self.received:
            self.keep_alive = False
            self._fail(StaleConnection())  # a kept-alive connection the server had closed
        else:
            self.keep_alive = False
            self._parse(b"")  # h11 ends a close-delimited body, or reports what is missing
            self._fail(ConnectionResetError("the connection closed before a whole response"))

    def _parse(self, chunk: bytes) -> None:
        """Feed the response reader; act once the head (or an error, whole) is in."""
        try:
            if not self.answer.feed(chunk):
                return
            if 200 <= self.answer.status < 300:
                self._response()
                return
        except (ConnectionResetError, UnsupportedResponse) as exc:
            self._fail(exc)
            return
        except ValueError as exc:  # a head not receivable in place (a bad Content-Length)
            self._fail(UnsupportedResponse(exc))
            return
        self.keep_alive = self.answer.keep_alive
        self._finish()

    def _response(self) -> None:
        """A successful head: its body goes into the sink, or is skipped up to the range."""
        status, headers = self.answer.status, self.answer.headers
        self.keep_alive = self.answer.keep_alive
        length = in_place_length(status, headers, self.start, self.end)
        leftover = memoryview(self.answer.leftover())  # body bytes that came with the head
        if (status == 200 and self.start != 0) or length > self.end - self.start:
            # The whole object for a ranged GET: skip to the range, and close the
            # connection once it is in rather than read the rest.
            warn_range_ignored(self.connection.endpoint)
            self.skip, self.keep_alive = self.start, False
            dropped = min(self.skip, len(leftover))
            self.skip -= dropped
            leftover = leftover[dropped:]
        if len(leftover) > self.end - self.start and self.keep_alive:
            self._fail(ConnectionResetError("the server sent more than the response"))
            return
        if not self.skip:
            self._start_body()
        if leftover:
            useful = leftover[: self.end - self.start]
            copy_into(self.sink, self.position, useful)
            self.position += len(useful)
            if self.position == self.end:
                self._finish()

    def _start_body(self) -> None:
        self.in_body = True
        if self.position == self.end:
            self._finish()

    def _finish(self) -> None:
        if self.future.done():
            return
        status = self.answer.status
        if 200 <= status < 300:
            self.future.set_result(None)
        elif 300 <= status < 400:
            location = self.answer.headers.get("location", "?")
            self.future.set_exception(UnsupportedResponse(f"redirect {status} to {location}"))
        else:
            self.future.set_exception(client_error(*self.answer.result()))

    def _fail(self, exc: BaseException) -> None:
        self.keep_alive = False
        if not self.future.done():
            self.future.set_exception(exc)

    def _stalled(self, connection: Connection) -> None:
        connection.timed_out = True
        self._fail(read_timeout(connection.endpoint))


def in_place_length(status: int, headers: dict[str, str], start: int, end: int) -> int:
    """The body length of a response received in place: a ``206`` for exactly the range
    asked for, with a ``Content-Length``, or a ``200`` with the whole object (a server
    that ignores ``Range``), at least as long as the range's end."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise UnsupportedResponse("chunked response")
    if "content-length" not in headers:
        raise UnsupportedResponse("response without Content-Length")
    length = int(headers["content-length"])
    if status == 206:
        unit, _, spec = headers.get("content-range", "").partition(" ")
        first, _, last = spec.partition("/")[0].partition("-")
        if unit != "bytes" or (first, last) != (str(start), str(end - 1)):
            raise UnsupportedResponse(f"unexpected Content-Range {headers.get('content-range')!r}")
    elif status == 200:
        if length < end:
            raise UnsupportedResponse(f"a {length}-byte object for bytes up to {end}")
        return length
    else:
        raise UnsupportedResponse(f"status {status} for a ranged GET")
    if length != end - start:
        raise UnsupportedResponse(f"{length} bytes for a {end - start}-byte range")
    return length


_warned_range_ignored: set[str] = set()


def warn_range_ignored(endpoint: str) -> None:
    """Warn once per endpoint that it sends whole objects for ranged GETs."""
    if endpoint not in _warned_range_ignored:
        _warned_range_ignored.add(endpoint)
        log.warning(
            "%s ignores Range (it sent a whole object for a ranged GET): loads work, but "
            "every ranged read transfers the object up to the range's end",
            endpoint,
        )


def client_error(status: int, headers: dict[str, str], body: bytes) -> ClientError:
    """The botocore ``ClientError`` aiobotocore would raise for this error response."""
    error = {"Code": str(status), "Message": ""}
    with contextlib.suppress(ElementTree.ParseError, ValueError):
        root = ElementTree.fromstring(body) if body.strip() else None
        if root is not None:
            error["Code"] = root.findtext("Code") or error["Code"]
            error["Message"] = root.findtext("Message") or ""
    metadata = {"HTTPStatusCode": status, "HTTPHeaders": headers}
    if "x-amz-request-id" in headers:
        metadata["RequestId"] = headers["x-amz-request-id"]
    return ClientError({"Error": error, "ResponseMetadata": metadata}, "GetObject")
