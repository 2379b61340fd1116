"""One blocking HTTP/1.1 request with a body on one TLS connection, run in a worker thread.

The body is sent by ``sendall`` from the caller's memory (part uploads and PUTs;
:mod:`s3ckpt.s3.tls_socket` says why), and the response, head and small body, is parsed
by h11 and handed back whole for botocore to interpret. A kept-alive connection that
turns out closed before any response byte raises
:class:`~s3ckpt.s3.tls_socket.StaleConnection` (the request goes again on a fresh one);
a response silent for ``read_timeout`` raises botocore's ``ReadTimeoutError``; a dropped
connection, a ``ConnectionError`` that :mod:`s3ckpt.s3.retry` retries. When the server
answers and closes before taking the whole body (an error it decided on from the
headers), that answer is returned, not the failed send.
"""

from __future__ import annotations

import select
import ssl

import h11
from botocore import exceptions as bce

from s3ckpt.s3.compat_botocore import read_timeout
from s3ckpt.s3.http_response import MAX_ERROR_BODY, MAX_HEADER_BYTES, _parser
from s3ckpt.s3.tls_socket import StaleConnection, TlsConnection

Head = tuple[int, dict[str, str]]


class _Exchange:
    """One request and its response on ``connection``."""

    def __init__(self, connection: TlsConnection) -> None:
        self.connection = connection
        self.parser = _parser()
        self.scratch = bytearray(MAX_HEADER_BYTES)
        self.received = False  # any byte of the response arrived

    def send(self, data: bytes | memoryview) -> None:
        try:
            self.connection.sock.sendall(data)
        except TimeoutError as exc:
            # botocore has no write timeout; a send stalled past the timeout is its read timeout
            raise read_timeout(self.connection.endpoint) from exc
        except OSError as exc:
            if self.connection.used and not self.received:
                raise StaleConnection from exc
            raise _dropped(exc) from exc

    def recv_into(self, view: memoryview | bytearray) -> int:
        """Receive into ``view``; 0 at the end of the stream."""
        try:
            count = self.connection.sock.recv_into(view)
        except TimeoutError as exc:
            raise read_timeout(self.connection.endpoint) from exc
        except ssl.SSLZeroReturnError:
            count = 0
        except OSError as exc:
            if self.connection.used and not self.received:
                raise StaleConnection from exc
            raise _dropped(exc) from exc
        if count:
            self.received = True
        elif self.connection.used and not self.received:
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


def send_request(
    connection: TlsConnection, head: bytes, body: memoryview
) -> tuple[tuple[int, dict[str, str], bytes], bool]:
    """Send a request with ``body`` (from its own memory); the response's status, headers
    and (small) body, and whether the connection may be kept."""
    exchange = _Exchange(connection)
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


def _answered(connection: TlsConnection) -> bool:
    """Whether response bytes are waiting on a connection whose send just failed."""
    try:
        return bool(connection.sock.pending()) or _readable(connection.sock)
    except (OSError, ValueError):
        return False


def _readable(sock: ssl.SSLSocket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def _dropped(exc: OSError) -> ConnectionError:
    """A failed send or receive as a retryable connection error (TLS alerts included)."""
    if isinstance(exc, ConnectionError):
        return exc
    reason = getattr(exc, "reason", None) or type(exc).__name__
    return ConnectionResetError(f"the TLS connection failed ({reason})")
