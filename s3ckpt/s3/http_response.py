"""One ranged GET on one kept-alive HTTP/1.1 connection, received into a sink.

:class:`Connection` is an :class:`asyncio.BufferedProtocol`: the response headers are read
into a small scratch buffer and parsed, then the event loop's ``recv_into`` writes the
body directly into the memory the caller's :class:`RangeSink` names (usually the
destination tensor), so each byte is copied once, by the kernel. Error responses are read
whole and become the botocore ``ClientError`` aiobotocore would raise; a successful
response this module cannot receive in place (chunked encoding, ``Range`` ignored) raises
:class:`UnsupportedResponse`. A response that stalls for ``read_timeout`` seconds is
aborted. Signing, connection reuse and TLS settings are :mod:`s3ckpt.s3.http_range`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import xml.etree.ElementTree as ElementTree
from typing import Protocol

from botocore import exceptions as bce
from botocore.exceptions import ClientError

from s3ckpt.s3.retry import ShortReadError

MAX_HEADER_BYTES = 64 * 1024
MAX_ERROR_BODY = 1024 * 1024
# Largest single receive: big enough that the loop wakes rarely, small enough that the
# bytes are still in cache when the sink checksums them right after.
MAX_RECEIVE = 1024 * 1024


class RangeSink(Protocol):
    """Where the bytes of one ranged GET go, asked for as they arrive, in offset order."""

    def buffer(self, offset: int) -> memoryview:
        """Writable memory for the bytes starting at ``offset`` (non-empty)."""
        ...

    def filled(self, offset: int, nbytes: int) -> None:
        """``nbytes`` bytes at ``offset`` have been written into the last buffer given."""
        ...


def copy_into(sink: RangeSink, offset: int, chunk: bytes | bytearray | memoryview) -> None:
    """Hand ``chunk`` (received elsewhere, e.g. by aiohttp) to ``sink`` by copying it."""
    view = memoryview(chunk)
    done = 0
    while done < len(view):
        target = sink.buffer(offset + done)
        count = min(len(target), len(view) - done)
        target[:count] = view[done : done + count]
        sink.filled(offset + done, count)
        done += count


class UnsupportedResponse(Exception):
    """A successful response this reader cannot receive in place; use aiobotocore instead."""


class StaleConnection(Exception):
    """A kept-alive connection closed before any byte of the response arrived."""


class Connection(asyncio.BufferedProtocol):
    """One HTTP/1.1 connection carrying one ranged GET at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout: float, endpoint: str) -> None:
        self.loop = loop
        self.read_timeout = read_timeout
        self.endpoint = endpoint
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.used = False
        self.scratch = memoryview(bytearray(MAX_HEADER_BYTES))
        self.response: _Response | None = None

    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    async def get(self, request: bytes, start: int, end: int, sink: RangeSink) -> None:
        assert self.transport is not None and self.response is None
        reused, self.used = self.used, True
        response = self.response = _Response(self, start, end, sink)
        self.transport.write(request)
        try:
            await response.future
        except (ConnectionError, ShortReadError) as exc:
            if reused and not response.head:
                raise StaleConnection from exc
            raise
        finally:
            response.stop_timer()
            self.response = None
            if not response.keep_alive:
                self.close()

    def close(self) -> None:
        self.closed = True
        if self.response is not None:
            self.response.stop_timer()
            self.response = None
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio protocol callbacks -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        response = self.response
        return self.scratch if response is None else response.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        response = self.response
        if response is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        response.data(nbytes)

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is not None and not response.future.done():
            if response.error is not None:  # an error body read until the server closed
                response.keep_alive = False
                response.finish()
            elif response.headers_done:
                response.fail(
                    ShortReadError(
                        f"the connection closed after {response.position - response.start} "
                        f"bytes of a {response.end - response.start}-byte range"
                    )
                )
            else:
                response.fail(ConnectionResetError("the connection closed before a response"))


class _Response:
    """The state of one response: headers into scratch, then the body into the sink."""

    def __init__(self, connection: Connection, start: int, end: int, sink: RangeSink) -> None:
        self.connection = connection
        self.start = start
        self.end = end
        self.sink = sink
        self.future: asyncio.Future[None] = connection.loop.create_future()
        self.head = bytearray()
        self.headers_done = False
        self.keep_alive = True
        self.position = start  # next body byte expected
        self.body_left = 0
        self.error: tuple[int, dict[str, str]] | None = None
        self.error_body = bytearray()
        self.into_sink = False
        self.last_progress = connection.loop.time()
        self.timer: asyncio.TimerHandle | None = connection.loop.call_later(
            connection.read_timeout, self._check_stall
        )

    def buffer(self) -> memoryview:
        if self.headers_done and self.error is None and self.body_left:
            view = self.sink.buffer(self.position)
            limit = min(self.body_left, MAX_RECEIVE)
            self.into_sink = True
            return view[:limit] if len(view) > limit else view
        self.into_sink = False
        return self.connection.scratch

    def data(self, nbytes: int) -> None:
        self.last_progress = self.connection.loop.time()
        if self.into_sink:
            self._body(nbytes)
            return
        chunk = self.connection.scratch[:nbytes]
        if not self.headers_done:
            self._head(chunk)
        elif self.error is not None:
            self._error_bytes(chunk)
        else:  # bytes after the end of the response
            self.fail(ConnectionResetError("the server sent more than the response"))

    def _body(self, nbytes: int) -> None:
        self.sink.filled(self.position, nbytes)
        self.position += nbytes
        self.body_left -= nbytes
        if self.body_left == 0:
            self.finish()

    def _head(self, chunk: memoryview) -> None:
        self.head += chunk
        end = self.head.find(b"\r\n\r\n")
        if end < 0:
            if len(self.head) > MAX_HEADER_BYTES:
                self.fail(ConnectionResetError("response headers too large"))
            return
        leftover = memoryview(bytes(self.head[end + 4 :]))  # body bytes read with the head
        try:
            status, headers, self.keep_alive = _parse_head(bytes(self.head[:end]))
            if 200 <= status < 300:
                self.body_left = _expected_length(status, headers, self.start, self.end)
            else:
                self.error = (status, headers)
                self.body_left = _error_length(headers)
        except Exception as exc:  # any malformed head fails this response
            self.fail(exc)
            return
        self.headers_done = True
        if self.error is not None:
            self._error_bytes(leftover)
        elif len(leftover) > self.body_left:
            self.fail(ConnectionResetError("the server sent more than the response"))
        elif leftover:
            copy_into(_Counting(self), self.position, leftover)

    def _error_bytes(self, chunk: memoryview) -> None:
        self.error_body += chunk
        if self.body_left >= 0 and len(self.error_body) >= self.body_left:
            self.finish()
        elif len(self.error_body) > MAX_ERROR_BODY:
            self.keep_alive = False
            self.finish()

    def finish(self) -> None:
        if self.future.done():
            return
        if self.error is None:
            self.future.set_result(None)
            return
        status, headers = self.error
        self.keep_alive = self.keep_alive and len(self.error_body) == self.body_left
        self.future.set_exception(_client_error(status, headers, bytes(self.error_body)))

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)
        self.connection.close()

    def _check_stall(self) -> None:
        self.timer = None
        if self.future.done():
            return
        idle = self.connection.loop.time() - self.last_progress
        if idle >= self.connection.read_timeout:
            self.fail(bce.ReadTimeoutError(endpoint_url=self.connection.endpoint))
            return
        self.timer = self.connection.loop.call_later(
            self.connection.read_timeout - idle, self._check_stall
        )

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class _Counting:
    """The response's sink as seen by :func:`copy_into`, for body bytes read with the head:
    each piece advances the response as a direct receive would."""

    def __init__(self, response: _Response) -> None:
        self.response = response

    def buffer(self, offset: int) -> memoryview:
        return self.response.sink.buffer(offset)

    def filled(self, offset: int, nbytes: int) -> None:
        self.response._body(nbytes)


def _parse_head(head: bytes) -> tuple[int, dict[str, str], bool]:
    """Status, lower-cased headers and whether the connection stays open."""
    status_line, *lines = head.decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    if not version.startswith("HTTP/1."):
        raise ConnectionResetError("not an HTTP/1.x response")
    status = int(rest.split(" ", 1)[0])
    headers: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    connection = headers.get("connection", "").lower()
    keep_alive = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
    return status, headers, keep_alive


def _expected_length(status: int, headers: dict[str, str], start: int, end: int) -> int:
    """The body length of a successful response, checked against the range asked for."""
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
    elif status != 200 or start != 0:
        raise UnsupportedResponse(f"status {status} for a ranged GET")
    if length != end - start:
        raise UnsupportedResponse(f"{length} bytes for a {end - start}-byte range")
    return length


def _error_length(headers: dict[str, str]) -> int:
    if "content-length" in headers and "chunked" not in headers.get("transfer-encoding", ""):
        return int(headers["content-length"])
    return -1  # read until the server closes (bounded by MAX_ERROR_BODY)


def _client_error(status: int, headers: dict[str, str], body: bytes) -> ClientError:
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
