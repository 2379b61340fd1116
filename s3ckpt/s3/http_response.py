"""One ranged GET on one kept-alive HTTP/1.1 connection, received into a sink.

:class:`Connection` is an :class:`asyncio.BufferedProtocol`. Response heads, interim
``1xx`` responses and every body but the expected one are parsed by h11 (a well-kept
HTTP/1.1 state machine), so chunked and close-delimited error bodies, ``100 Continue``
and ``Connection: close`` are handled as HTTP says. The expected one, a ``206`` whose
``Content-Range`` and ``Content-Length`` match the range asked for, is received in place:
the event loop's ``recv_into`` writes it directly into the memory the caller's
:class:`RangeSink` names (usually the destination tensor), so each byte is copied once,
by the kernel. Error responses become the botocore ``ClientError`` aiobotocore would
raise; a successful response this module cannot receive in place (chunked, ``Range``
ignored) and redirects raise :class:`UnsupportedResponse`, so the caller hands the
request to aiobotocore. A response that stalls for ``read_timeout`` seconds is aborted.
Signing, connection reuse and TLS settings are :mod:`s3ckpt.s3.http_range`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import xml.etree.ElementTree as ElementTree
from typing import Protocol

import h11
from botocore.exceptions import ClientError

from s3ckpt.s3.compat_botocore import read_timeout
from s3ckpt.s3.retry import ShortReadError

log = logging.getLogger(__name__)

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
            response.closed()


class _Response:
    """The state of one response: the head (and any other body) through h11, then the
    expected body straight into the sink."""

    def __init__(self, connection: Connection, start: int, end: int, sink: RangeSink) -> None:
        self.connection = connection
        self.start = start
        self.end = end
        self.sink = sink
        self.future: asyncio.Future[None] = connection.loop.create_future()
        self.parser = _parser()
        self.head = False  # any byte of a response arrived
        self.headers_done = False  # the final head was parsed
        self.keep_alive = True
        self.position = start  # next body byte expected
        self.body_left = 0
        self.skip = 0  # body bytes before the range, from a server that ignored Range
        self.error: tuple[int, dict[str, str]] | None = None
        self.error_body = bytearray()
        self.into_sink = False
        self.last_progress = connection.loop.time()
        self.timer: asyncio.TimerHandle | None = connection.loop.call_later(
            connection.read_timeout, self._check_stall
        )

    def buffer(self) -> memoryview:
        if self.skip:
            self.into_sink = False
            return self.connection.scratch[: min(self.skip, len(self.connection.scratch))]
        if self.headers_done and self.error is None and self.body_left:
            view = self.sink.buffer(self.position)
            limit = min(self.body_left, MAX_RECEIVE)
            self.into_sink = True
            return view[:limit] if len(view) > limit else view
        self.into_sink = False
        return self.connection.scratch

    def data(self, nbytes: int) -> None:
        self.last_progress = self.connection.loop.time()
        self.head = True
        if self.into_sink:
            self._body(nbytes)
        elif self.skip:
            self.skip -= nbytes  # buffer() asked for no more than the bytes to skip
        elif self.headers_done and self.error is None:  # bytes after the end of the response
            self.fail(ConnectionResetError("the server sent more than the response"))
        else:
            self._parse(bytes(self.connection.scratch[:nbytes]))

    def closed(self) -> None:
        """The server closed the connection: ends a close-delimited body, or the response."""
        if self.headers_done and self.error is None:
            self.fail(
                ShortReadError(
                    f"the connection closed after {self.position - self.start} "
                    f"bytes of a {self.end - self.start}-byte range"
                )
            )
        else:
            self.keep_alive = False
            self._parse(b"")  # h11 ends a close-delimited body, or reports what is missing
            self.fail(ConnectionResetError("the connection closed before a whole response"))

    def _body(self, nbytes: int) -> None:
        self.sink.filled(self.position, nbytes)
        self.position += nbytes
        self.body_left -= nbytes
        if self.body_left == 0:
            self.finish()

    def _parse(self, chunk: bytes) -> None:
        """Feed h11 and act on what it recognises, until it needs more bytes."""
        try:
            self.parser.receive_data(chunk)
            while not self.future.done():
                event = self.parser.next_event()
                if event is h11.NEED_DATA or isinstance(event, h11.InformationalResponse):
                    if event is h11.NEED_DATA:
                        return
                elif isinstance(event, h11.Response):
                    self._response(event)
                    if self.error is None:
                        return
                elif isinstance(event, h11.Data):
                    self._error_bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    self.keep_alive = self.parser.their_state is h11.DONE
                    self.finish()
                else:  # ConnectionClosed: the end of a close-delimited error body, or early
                    self.keep_alive = False
                    if self.error is None:
                        self.fail(ConnectionResetError("the connection closed before a response"))
                    self.finish()
        except h11.RemoteProtocolError as exc:
            self.fail(ConnectionResetError(f"malformed HTTP response: {exc}"))
        except (UnsupportedResponse, ValueError) as exc:  # not receivable in place
            self.fail(exc if isinstance(exc, UnsupportedResponse) else UnsupportedResponse(exc))

    def _response(self, event: h11.Response) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
        self.headers_done = True
        if not 200 <= event.status_code < 300:
            self.error = (event.status_code, headers)
            return
        length = _in_place_length(event.status_code, headers, self.start, self.end)
        self.keep_alive = event.http_version == b"1.1" and (
            headers.get("connection", "").lower() != "close"
        )
        leftover, _ = self.parser.trailing_data  # body bytes that came with the head
        self.body_left = self.end - self.start
        if (event.status_code == 200 and self.start != 0) or length > self.body_left:
            # The whole object for a ranged GET: skip to the range, and close the
            # connection once it is in rather than read the rest.
            warn_range_ignored(self.connection.endpoint)
            self.skip, self.keep_alive = self.start, False
            dropped = min(self.skip, len(leftover))
            self.skip -= dropped
            leftover = leftover[dropped:]
        if len(leftover) > self.body_left and self.keep_alive:
            self.fail(ConnectionResetError("the server sent more than the response"))
        elif leftover:
            copy_into(_Counting(self), self.position, leftover[: self.body_left])
        elif self.body_left == 0:
            self.finish()

    def _error_bytes(self, chunk: bytes) -> None:
        self.error_body += chunk
        if len(self.error_body) > MAX_ERROR_BODY:  # not an S3 error document: stop here
            self.keep_alive = False
            self.finish()

    def finish(self) -> None:
        if self.future.done():
            return
        if self.error is None:
            self.future.set_result(None)
            return
        status, headers = self.error
        if 300 <= status < 400:
            self.future.set_exception(
                UnsupportedResponse(f"redirect {status} to {headers.get('location', '?')}")
            )
            return
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
            self.fail(read_timeout(self.connection.endpoint))
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


def _parser() -> h11.Connection:
    """An h11 client connection in the state of one GET sent (the request itself was
    written as bytes; h11 only reads the response)."""
    parser = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)
    parser.send(h11.Request(method="GET", target="/", headers=[("Host", "s3")]))
    parser.send(h11.EndOfMessage())
    return parser


def _in_place_length(status: int, headers: dict[str, str], start: int, end: int) -> int:
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
