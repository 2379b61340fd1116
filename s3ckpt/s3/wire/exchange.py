"""One HTTP/1.1 request and its response on one blocking connection, in a worker thread.

Request bodies are sent by ``sendall`` from the caller's memory; response heads, interim
``1xx`` responses and small bodies (upload answers, error documents, chunked or
close-delimited included) are parsed by h11, a well-kept HTTP/1.1 state machine. The
bodies of ranged GETs bypass it and go straight into the reader's memory (:mod:`s3ckpt.s3.wire.get_exchange`).

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
from s3ckpt.s3.wire.connection import Connection, StaleConnection

MAX_HEADER_BYTES = 64 * 1024
MAX_SMALL_BODY = 16 * 1024 * 1024  # a listing page of 1000 long keys runs to a few MB
# Bytes per sendall: each one marks progress for the stall timer, and costs one call.
SEND_CHUNK = 8 * 1024 * 1024


class Exchange:
    """One request and its response on ``connection``."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
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

    def recv_into(self, view: memoryview) -> int:
        """Receive into ``view``; 0 at the end of the stream."""
        connection = self.connection
        try:
            count = connection.recv_into(view)
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

    def response(self, *, to_head: bool = False) -> SmallResponse:
        """The whole response, its (small) body included (none ``to_head``)."""
        response = SmallResponse(to_head=to_head)
        while True:
            count = self.recv_into(self.scratch)
            if response.feed(bytes(self.scratch[:count])):
                return response
            if not count:
                raise ConnectionResetError("the connection closed before a whole response")

    def _failed(self, exc: OSError) -> Exception:
        return failure(self.connection, exc, reused=self.connection.used, received=self.received)


def send_request(
    connection: Connection, head: bytes, body: memoryview
) -> tuple[tuple[int, dict[str, str], bytes], bool]:
    """Send a request with ``body`` (from its own memory; blocking mode); the response's
    status, headers and (small) body, and whether the connection may be kept."""
    exchange = Exchange(connection)
    try:
        exchange.send(head)
        if len(body):
            exchange.send(body)
    except (ConnectionError, bce.ConnectionClosedError):
        # The server may have answered (an error) and closed before taking the whole body:
        # that answer is the one worth reporting.
        if not answered(connection):
            raise
    response = exchange.response(to_head=is_head(head))
    return response.result(), response.keep_alive


class SmallResponse:
    """A response head and its small body (an upload's answer, an error document), read by
    h11 from the bytes whoever receives them feeds in: the one response parser of the
    data plane, for blocking exchanges and the event loop's alike.

    ``body_in_place``: a successful (``2xx``) response is whole once its head is: its body
    is the caller's to receive (:mod:`s3ckpt.s3.wire.get_exchange`), the bytes that came
    with the head in :meth:`leftover`.
    """

    def __init__(self, *, body_in_place: bool = False, to_head: bool = False) -> None:
        self.body_in_place = body_in_place
        self.parser = response_parser("HEAD" if to_head else "GET")
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.keep_alive = False

    def feed(self, data: bytes) -> bool:
        """Bytes received (``b""``: the end of the stream); whether the response is whole."""
        try:
            self.parser.receive_data(data)
            while True:
                event = self.parser.next_event()
                if event is h11.NEED_DATA:
                    return False
                if isinstance(event, h11.Response):
                    self.status = event.status_code
                    self.headers = {
                        k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers
                    }
                    if self.body_in_place and 200 <= self.status < 300:
                        self.keep_alive = event.http_version == b"1.1" and (
                            self.headers.get("connection", "").lower() != "close"
                        )
                        return True
                elif isinstance(event, h11.Data):
                    self.body += event.data
                    if len(self.body) > MAX_SMALL_BODY:  # not an S3 document: stop here
                        return True
                elif isinstance(event, h11.EndOfMessage):
                    self.keep_alive = self.parser.their_state is h11.DONE and (
                        self.headers.get("connection", "").lower() != "close"
                    )
                    return True
                elif isinstance(event, h11.ConnectionClosed):
                    if not self.status:
                        raise ConnectionResetError("the connection closed before a response")
                    return True  # the end of a close-delimited body
        except h11.RemoteProtocolError as exc:
            raise ConnectionResetError(f"malformed HTTP response: {exc}") from exc

    def leftover(self) -> bytes:
        """The body bytes received with the head (``body_in_place``)."""
        data: bytes = self.parser.trailing_data[0]
        return data

    def result(self) -> tuple[int, dict[str, str], bytes]:
        return self.status, self.headers, bytes(self.body)


def response_parser(method: str = "GET") -> h11.Connection:
    """An h11 client connection in the state of one request sent (the request itself was
    written as bytes; h11 only reads the response). ``HEAD``: the response has no body,
    whatever its ``Content-Length`` says."""
    parser = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)
    parser.send(h11.Request(method=method, target="/", headers=[("Host", "s3")]))
    parser.send(h11.EndOfMessage())
    return parser


def is_head(head: bytes) -> bool:
    """Whether the request ``head`` (its bytes as sent) is a ``HEAD``, answered without a
    body."""
    return head.startswith(b"HEAD ")


def answered(connection: Connection) -> bool:
    """Whether response bytes are waiting on a connection whose send just failed."""
    return not connection.timed_out and not connection.idle_and_sound()


def failure(connection: Connection, exc: OSError, *, reused: bool, received: bool) -> Exception:
    """What a failed send or receive on ``connection`` is, by the data plane's one policy
    (blocking exchanges and the event loop's alike): past ``read_timeout`` (the stall timer
    cut it short), botocore's ``ReadTimeoutError``; on a kept-alive connection (``reused``)
    before any byte of the response came, :class:`StaleConnection` (the server had closed
    it: the request goes again on a fresh one); else a dropped connection."""
    if connection.timed_out:
        return read_timeout(connection.endpoint)
    if reused and not received:
        return StaleConnection()
    return dropped(exc)


def dropped(exc: OSError) -> ConnectionError:
    """A failed send or receive as a retryable connection error (TLS alerts included)."""
    if isinstance(exc, ConnectionError):
        return exc
    reason = getattr(exc, "reason", None) or type(exc).__name__
    return ConnectionResetError(f"the connection failed ({reason})")
