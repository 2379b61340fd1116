"""One HTTP/1.1 request and its response on one blocking connection, in a worker thread.

Request bodies are sent by ``sendall`` from the caller's memory; response heads, interim
``1xx`` responses and small bodies (upload answers, error documents, chunked or
close-delimited included) are parsed by h11, a well-kept HTTP/1.1 state machine. The
bodies of ranged GETs bypass it and go straight into the sink (:mod:`s3ckpt.s3.wire.range_body`).

Failures come out as what :mod:`s3ckpt.s3.retry` and :mod:`s3ckpt.s3.error_mapping` know:
a connection that stalled past ``read_timeout`` as botocore's ``ReadTimeoutError``; a
dropped one as a ``ConnectionError``; a kept-alive one that turns out closed before any
response byte as :class:`~s3ckpt.s3.wire.pool.StaleConnection` (the request goes again
on a fresh one). When the server answers and closes before taking the whole body (an
error it decided on from the headers), that answer is returned, not the failed send.
"""

from __future__ import annotations

import time

import h11
from botocore import exceptions as bce

from s3ckpt.s3.compat_botocore import read_timeout
from s3ckpt.s3.wire.pool import Connection, StaleConnection

MAX_HEADER_BYTES = 64 * 1024
MAX_ERROR_BODY = 1024 * 1024
# Bytes per sendall: each one marks progress for the stall timer, and costs one call.
SEND_CHUNK = 8 * 1024 * 1024

Head = tuple[int, dict[str, str]]


class Exchange:
    """One request and its response on ``connection``."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.parser = response_parser()
        self.scratch = memoryview(bytearray(MAX_HEADER_BYTES))
        self.received = False  # any byte of the response arrived

    def send(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        connection = self.connection
        try:
            for start in range(0, len(view), SEND_CHUNK):
                connection.send_all(view[start : start + SEND_CHUNK])
                connection.progress = time.monotonic()
        except OSError as exc:
            raise self._failed(exc) from exc

    def recv_into(self, view: memoryview, *, whole: bool = False) -> int:
        """Receive into ``view``; 0 at the end of the stream. ``whole``: wait until all of
        ``view`` is filled or the stream ends, so the caller handles one large piece."""
        connection = self.connection
        try:
            count = connection.recv_into(view, whole=whole)
        except OSError as exc:
            raise self._failed(exc) from exc
        if connection.timed_out:
            raise read_timeout(connection.endpoint)
        if count:
            self.received = True
            connection.progress = time.monotonic()
        elif connection.used and not self.received:
            raise StaleConnection
        return count

    def head(self) -> tuple[h11.Response, Head]:
        """The final response head (interim ``1xx`` skipped), as h11 parsed it."""
        while True:
            event = self._next()
            if isinstance(event, h11.Response):
                headers = {
                    k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers
                }
                return event, (event.status_code, headers)
            if not isinstance(event, h11.InformationalResponse):
                raise ConnectionResetError("the connection closed before a response")

    def small_body(self) -> tuple[bytes, bool]:
        """A whole (small) body through h11, and whether the connection may be kept."""
        body = bytearray()
        while True:
            event = self._next()
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_ERROR_BODY:  # not an S3 document: stop reading here
                    return bytes(body), False
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body), self.parser.their_state is h11.DONE
            else:  # the end of a close-delimited body
                return bytes(body), False

    def _next(self) -> h11.Event | type[h11.NEED_DATA]:
        try:
            while (event := self.parser.next_event()) is h11.NEED_DATA:
                count = self.recv_into(self.scratch)
                self.parser.receive_data(bytes(self.scratch[:count]))
        except h11.RemoteProtocolError as exc:
            raise ConnectionResetError(f"malformed HTTP response: {exc}") from exc
        return event

    def _failed(self, exc: OSError) -> Exception:
        connection = self.connection
        if connection.timed_out:
            return read_timeout(connection.endpoint)
        if connection.used and not self.received:
            return StaleConnection()
        return _dropped(exc)


def send_request(
    connection: Connection, head: bytes, body: memoryview
) -> tuple[tuple[int, dict[str, str], bytes], bool]:
    """Send a request with ``body`` (from its own memory); the response's status, headers
    and (small) body, and whether the connection may be kept."""
    exchange = Exchange(connection)
    try:
        exchange.send(head)
        if len(body):
            exchange.send(body)
    except (ConnectionError, bce.ConnectionClosedError):
        # The server may have answered (an error) and closed before taking the whole body:
        # that answer is the one worth reporting.
        if not _answered(connection):
            raise
    _, (status, headers) = exchange.head()
    content, keep_alive = exchange.small_body()
    return (status, headers, content), keep_alive and headers.get("connection") != "close"


def response_parser() -> h11.Connection:
    """An h11 client connection in the state of one request sent (the request itself was
    written as bytes; h11 only reads the response)."""
    parser = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)
    parser.send(h11.Request(method="GET", target="/", headers=[("Host", "s3")]))
    parser.send(h11.EndOfMessage())
    return parser


def _answered(connection: Connection) -> bool:
    """Whether response bytes are waiting on a connection whose send just failed."""
    return not connection.timed_out and not connection.idle_and_sound()


def _dropped(exc: OSError) -> ConnectionError:
    """A failed send or receive as a retryable connection error (TLS alerts included)."""
    if isinstance(exc, ConnectionError):
        return exc
    reason = getattr(exc, "reason", None) or type(exc).__name__
    return ConnectionResetError(f"the connection failed ({reason})")
