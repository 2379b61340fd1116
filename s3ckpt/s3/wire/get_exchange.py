"""Ranged GETs on the pool's connections, on the event loop, each body pulled into the
caller's memory.

:class:`RangedGets` signs each request as a presigned URL from the aiobotocore client
(SigV4 query authentication), so credentials, regions, session tokens and addressing
style are handled by the client in one place and never appear in a header built here. A
presigned URL is reused for every range of its object for a few minutes (``Range`` is not
signed), and signed anew when a reused one is refused.

:func:`open_range` sends the request and reads the response head; the caller then pulls
the body with :meth:`RangeResponse.receive_into`, which receives straight into the memory
it names: the receive calls the non-blocking socket's ``recv_into`` with that memory
(woken by a reader callback on the loop when bytes arrive), so each byte is copied once,
by the kernel (plain TCP) or by OpenSSL as it decrypts (TLS). While no receive is pending
the socket is not read, so the kernel's buffer, not ours, holds what arrives. Reads stay on the loop thread because over TLS
OpenSSL hands over one 16 KiB record per call, and in worker threads each call's release
and re-take of the GIL would contend with the other requests' threads
(docs/decisions/0004-tls-path.md). Error responses become the botocore ``ClientError``
aiobotocore would raise, so :mod:`s3ckpt.s3.retry` and :mod:`s3ckpt.s3.error_mapping`
treat them like any other; a successful response that cannot be received in place
(chunked, no length, a redirect) raises :class:`UnsupportedResponse`, and the caller
hands the request to aiobotocore. A server that ignores ``Range`` and sends the whole
object has the range cut from it (and the connection closed once it is in).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import xml.etree.ElementTree as ElementTree
from typing import Any
from urllib.parse import SplitResult, urlsplit

from botocore.exceptions import ClientError

from s3ckpt._version import __version__
from s3ckpt.s3.compat_botocore import read_timeout
from s3ckpt.s3.retry import ShortReadError
from s3ckpt.s3.wire.connection import Connection, Origin, StaleConnection
from s3ckpt.s3.wire.exchange import MAX_HEADER_BYTES, SmallResponse, failure
from s3ckpt.s3.wire.on_loop import send_all
from s3ckpt.s3.wire.pool import ConnectionPool
from s3ckpt.s3.wire.stall import StallTimer

log = logging.getLogger(__name__)

PRESIGN_EXPIRES_S = 3600
REUSE_SIGNATURE_S = 300.0
MAX_CACHED_URLS = 4096


_NOTHING = memoryview(b"")


class UnsupportedResponse(Exception):
    """A successful response this reader cannot receive in place; use aiobotocore instead."""


class RangedGets:
    """Ranged GETs over the pool's kept-alive connections, signed by an aiobotocore client."""

    def __init__(self, client: Any, pool: ConnectionPool) -> None:
        self.client = client
        self.pool = pool
        self._urls: dict[tuple[str, str], tuple[float, SplitResult]] = {}

    async def open(self, bucket: str, key: str, start: int, end: int) -> RangeResponse:
        """Ask for bytes ``[start, end)`` of ``bucket/key``: the response, its head read,
        whose body the caller pulls (and then closes)."""
        url, reused = await self._signed(bucket, key)
        try:
            return await self._open(url, start, end)
        except ClientError as exc:
            if not reused or exc.response["ResponseMetadata"]["HTTPStatusCode"] != 403:
                raise
            # A reused signature may have outlived the credentials that made it: sign anew.
            url, _ = await self._signed(bucket, key, fresh=True)
            return await self._open(url, start, end)

    async def _signed(
        self, bucket: str, key: str, *, fresh: bool = False
    ) -> tuple[SplitResult, bool]:
        """A presigned GET URL for the object and whether it was reused."""
        now = time.monotonic()
        cached = self._urls.get((bucket, key))
        if cached is not None and not fresh and now - cached[0] < REUSE_SIGNATURE_S:
            return cached[1], True
        url = await self.client.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=PRESIGN_EXPIRES_S
        )
        if len(self._urls) >= MAX_CACHED_URLS:
            self._urls.clear()
        self._urls[(bucket, key)] = (now, urlsplit(url))
        return self._urls[(bucket, key)][1], False

    async def _open(self, url: SplitResult, start: int, end: int) -> RangeResponse:
        origin = (
            url.scheme,
            url.hostname or "",
            url.port or (443 if url.scheme == "https" else 80),
        )
        request = (
            f"GET {url.path}?{url.query} HTTP/1.1\r\nHost: {url.netloc}\r\n"
            f"Range: bytes={start}-{end - 1}\r\nAccept-Encoding: identity\r\n"
            f"User-Agent: s3ckpt/{__version__}\r\n\r\n"
        ).encode("ascii")
        return await open_range(self.pool, origin, request, start, end)


async def open_range(
    pool: ConnectionPool, origin: Origin, request: bytes, start: int, end: int
) -> RangeResponse:
    """Send the GET ``request`` for ``[start, end)`` on a connection to ``origin`` and read
    its head: the response whose body the caller pulls (and then closes). Raises the
    ``ClientError`` the server answered instead. A kept-alive connection the server had
    closed is replaced silently."""
    while True:
        response = RangeResponse(pool, await pool.checkout(origin), start, end)
        try:
            await response.open(request)
        except StaleConnection:
            response.close()
            continue
        except BaseException:
            response.close()
            raise
        return response


class RangeResponse:
    """One response, read by the task that pulls it while a step (its head, or a
    receive) is pending, woken by a reader callback on the event loop when bytes arrive:
    the head (and any body but the expected one) through h11, then the expected body
    straight into the memory each :meth:`receive_into` names. A reader callback that
    finds no step pending takes itself off the loop, so the socket is read only for a
    receive."""

    def __init__(self, pool: ConnectionPool, connection: Connection, start: int, end: int) -> None:
        self.pool = pool
        self.connection = connection
        self.loop = asyncio.get_running_loop()
        self.start = start
        self.end = end
        self.pending = False  # a step (the head, or a receive) is under way
        self.waiter: asyncio.Future[None] | None = None  # the task waiting for bytes
        self.reading = False  # the reader callback is on the loop
        self.fd = connection.sock.fileno()
        self.error: BaseException | None = None  # what ended the response early
        self.answer = SmallResponse(body_in_place=True)  # the head, or an error and its body
        self.scratch = memoryview(bytearray(MAX_HEADER_BYTES))
        self.received = False  # any byte of a response arrived
        self.reused = False  # the connection carried a request before (it may be stale)
        self.in_body = False  # the expected body is being received
        self.whole = False  # the response was read to its end (the connection may serve again)
        self.keep_alive = True
        self.position = start  # next body byte to deliver
        self.skip = 0  # body bytes before the range, from a server that ignored Range
        self.leftover = _NOTHING  # body bytes that came with the head
        self.view: memoryview | None = None  # the memory of the pending receive
        self.filled = 0  # bytes of ``view`` received so far
        self.watch: StallTimer | None = None

    async def open(self, request: bytes) -> None:
        """Send ``request`` and read the response's head; a failure is read by the data
        plane's one policy (:func:`~s3ckpt.s3.wire.exchange.failure`)."""
        connection = self.connection
        self.reused, connection.used = connection.used, True
        self.watch = StallTimer(
            self.loop, lambda: connection, self.pool.read_timeout, self._stalled
        )
        try:
            await send_all(connection, request)
        except OSError as exc:
            raise failure(connection, exc, reused=self.reused, received=False) from exc
        await self._wait()

    async def receive_into(self, view: memoryview) -> int:
        """Receive the next bytes of the range into ``view``; answers once ``view`` is
        full or the range is in (the count). :class:`~s3ckpt.s3.retry.ShortReadError`
        where the response ends early."""
        view = view[: self.end - self.position]
        if self.error is not None:
            raise self.error
        filled = 0
        if self.leftover:
            filled = min(len(self.leftover), len(view))
            view[:filled] = self.leftover[:filled]
            # a view of nothing, once taken, rather than of the bytes read with the head
            self.leftover = self.leftover[filled:] if filled < len(self.leftover) else _NOTHING
        if filled < len(view):
            self.view, self.filled = view, filled
            self.connection.progress = time.monotonic()  # stalls count while a receive waits
            try:
                await self._wait()
            except Exception:
                if not self.filled or self.view is None:
                    raise
                # the bytes that landed are delivered (a retry resumes after them); the
                # error, kept, is the next receive's
                count, self.view = self.filled, None
                self.position += count
                return count
        else:
            self.position += filled
            self.whole = self.position == self.end
        return len(view)

    async def aclose(self) -> None:
        """Stop receiving; the connection serves again only where the body was read whole."""
        self.close()

    def close(self) -> None:
        """Stop watching; the connection serves again where the response was read whole."""
        if self.watch is not None:
            self.watch.stop()
        self._pause()
        self.pool.release(self.connection, keep_alive=self.keep_alive and self.whole)

    async def _wait(self) -> None:
        """Read until the pending step (the head, or a receive) is done: what the socket
        has at once, then more each time the reader callback says some arrived. The
        reading is this task's own, so a receive's caller checks the bytes it landed right
        after, while they are in cache, before other connections' bytes come through."""
        self.pending = True
        self._read()
        while self.pending:
            self.waiter = self.loop.create_future()
            if not self.reading:
                self.loop.add_reader(self.fd, self._readable)
                self.reading = True
            try:
                await self.waiter
            except BaseException:  # cancelled: nothing is read into the memory from now on
                self.pending = False
                self._pause()
                raise
            finally:
                self.waiter = None
            self._read()
        if self.error is not None:
            raise self.error

    def _done(self) -> None:
        """The pending step is done (or failed)."""
        self.pending = False
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _pause(self) -> None:
        """Take the reader callback off the loop: the socket is not read."""
        if self.reading:
            self.reading = False
            self.loop.remove_reader(self.fd)

    def _readable(self) -> None:
        """The reader callback: bytes arrived; wake the task waiting to read them, or,
        with none waiting, stop reading (the kernel holds them until a receive asks)."""
        waiter = self.waiter
        if waiter is None or waiter.done():
            self._pause()
        else:
            waiter.set_result(None)

    # -- reading --------------------------------------------------------------------------

    def _read(self) -> None:
        """Read what the socket has (over TLS, record by record) until the pending step is
        done or it would block. The body's loop is kept short, as it runs once per 16 KiB
        record over TLS."""
        connection = self.connection
        received = 0
        try:
            while self.pending:
                if self.in_body:
                    view = self.view
                    assert view is not None
                    count = connection.recv_ready(view[self.filled :])
                    if count > 0:
                        received += count
                        self.filled += count
                        if self.filled == len(view):
                            self._delivered(len(view))
                        continue
                else:
                    count = connection.recv_ready(self._head_buffer())
                    if count > 0:
                        received += count
                        self.received = True
                        self._data(count)
                        continue
                if count == 0:
                    self._closed()
                return
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            got = self.received or received > 0
            self._fail(failure(connection, exc, reused=self.reused, received=got))
        finally:
            if received:
                self.received = True
                connection.progress = time.monotonic()

    def _delivered(self, count: int) -> None:
        """``count`` more bytes of the range are in the caller's memory."""
        self.position += count
        self.view = None
        self.whole = self.position == self.end
        self._done()

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

    def _closed(self) -> None:
        """The server closed the connection: ends a close-delimited body, or the response."""
        if self.connection.timed_out:
            self._fail(read_timeout(self.connection.endpoint))
        elif self.in_body or self.skip:
            self._fail(
                ShortReadError(
                    f"the connection closed after {self.position + self.filled - self.start} "
                    f"bytes of a {self.end - self.start}-byte range"
                )
            )
        elif self.reused and not self.received:
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
        self._answered()

    def _response(self) -> None:
        """A successful head: its body is the caller's, or is skipped up to the range."""
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
        self.leftover = leftover[: self.end - self.start]
        if not self.skip:
            self._start_body()

    def _start_body(self) -> None:
        """The head is in (and any bytes before the range skipped): the body is the caller's."""
        self.in_body = True
        self._done()

    def _answered(self) -> None:
        """A response other than the body expected, read whole."""
        self.whole = True
        status = self.answer.status
        if 300 <= status < 400:
            location = self.answer.headers.get("location", "?")
            self._fail(UnsupportedResponse(f"redirect {status} to {location}"))
        else:
            self._fail(client_error(*self.answer.result()), keep_alive=True)

    def _fail(self, exc: BaseException, *, keep_alive: bool = False) -> None:
        self.keep_alive = self.keep_alive and keep_alive
        if self.error is None:
            self.error = exc
        self._pause()
        self._done()

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
