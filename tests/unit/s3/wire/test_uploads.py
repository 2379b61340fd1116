"""Upload bodies on the data plane (``s3ckpt.s3.wire.on_loop.BodyTransport``), against a
scripted server on loopback, each scenario over plain HTTP (sent from the event loop) and
over HTTPS (sent from a worker thread on a blocking TLS socket): a body sent whole on a
kept-alive connection, a kept-alive connection the server closed, an answer that arrives
before the whole body was taken, a server that stops reading, a cancellation. And the
request head as signed, and the bodies left to aiohttp."""

from __future__ import annotations

import asyncio
import io
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import SplitResult, urlsplit

import pytest
from botocore import exceptions as bce
from scripted_servers import ThreadedServer, read_request

from s3ckpt.s3.retry import is_retryable
from s3ckpt.s3.wire.on_loop import BodyTransport
from s3ckpt.s3.wire.pool import ConnectionPool
from s3ckpt.s3.wire.uploads import BodySender, request_head
from s3ckpt.testing.tls_cert import write_tls_files

_OK = b'HTTP/1.1 200 OK\r\nETag: "e"\r\nContent-Length: 0\r\n\r\n'
Handler = Callable[[socket.socket], None]


@dataclass
class Endpoint:
    """A scripted server, and a transport whose pool trusts it."""

    server: ThreadedServer
    transport: BodyTransport
    url: SplitResult

    def head(self, length: int) -> bytes:
        return (
            f"PUT /b/k HTTP/1.1\r\nHost: {self.url.netloc}\r\nContent-Length: {length}\r\n\r\n"
        ).encode()

    async def send(self, body: bytes | memoryview) -> tuple[int, dict[str, str], bytes]:
        return await self.transport.send(self.url, self.head(len(body)), memoryview(body))


@pytest.fixture(params=["http", "https"])
def serve(request, tmp_path: Path) -> Iterator[Callable[..., Endpoint]]:
    """``serve(handle, read_timeout=5.0)``: a server over this test's scheme whose
    connections run ``handle``."""
    endpoints: list[Endpoint] = []

    def start(handle: Handler, *, read_timeout: float = 5.0) -> Endpoint:
        verify: bool | str = True
        context = None
        if request.param == "https":
            directory = tmp_path / str(len(endpoints))
            directory.mkdir()
            files = write_tls_files(directory)
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(files.cert_file, files.key_file)
            verify = str(files.ca_file)
        server = ThreadedServer(handle, context)
        pool = ConnectionPool(
            verify=verify, connect_timeout=5.0, read_timeout=read_timeout, max_idle=4
        )
        host = "localhost" if context else "127.0.0.1"  # the certificate's name
        endpoints.append(
            Endpoint(
                server, BodyTransport(pool), urlsplit(f"{request.param}://{host}:{server.port}/b/k")
            )
        )
        return endpoints[-1]

    yield start
    for endpoint in endpoints:
        endpoint.transport.pool.close_idle()
        endpoint.transport.pool.executor.shutdown(wait=True)
        endpoint.server.close()


def test_a_body_is_sent_whole_and_the_connection_kept(serve):
    lengths: list[int] = []

    def answer(sock: socket.socket) -> None:
        while (length := read_request(sock)) >= 0:
            lengths.append(length)
            sock.sendall(_OK)

    endpoint = serve(answer)
    body = memoryview(bytes(range(256)) * 40_000)  # larger than the socket buffers

    async def twice() -> list[int]:
        return [(await endpoint.send(body))[0] for _ in range(2)]

    assert asyncio.run(twice()) == [200, 200]
    assert lengths == [len(body)] * 2 and endpoint.server.accepted == 1  # kept alive, reused


def test_a_kept_alive_connection_the_server_closed_is_replaced(serve):
    closed = threading.Event()

    def answer_once(sock: socket.socket) -> None:
        read_request(sock)
        sock.sendall(_OK)  # keep-alive by default, but closed right after
        sock.close()
        closed.set()

    endpoint = serve(answer_once)

    async def twice() -> list[int]:
        statuses = []
        for _ in range(2):
            status, headers, _ = await endpoint.send(b"data")
            assert headers["etag"] == '"e"'
            statuses.append(status)
            assert await asyncio.to_thread(closed.wait, 10)  # the idle connection is closed
            closed.clear()
        return statuses

    assert asyncio.run(twice()) == [200, 200]
    assert endpoint.server.accepted == 2  # the stale connection was replaced, not reported


def test_an_answer_before_the_whole_body_is_what_the_caller_gets(serve):
    refusal = b"<Error><Code>AccessDenied</Code></Error>"

    def refuse_early(sock: socket.socket) -> None:
        sock.recv(65536)  # the head and no more of the body
        sock.sendall(
            b"HTTP/1.1 403 Forbidden\r\nConnection: close\r\n"
            + f"Content-Length: {len(refusal)}\r\n\r\n".encode()
            + refusal
        )
        time.sleep(0.5)

    endpoint = serve(refuse_early)
    status, _, content = asyncio.run(endpoint.send(memoryview(bytes(64 * 1024 * 1024))))
    assert (status, content) == (403, refusal)


def test_a_server_that_stops_reading_fails_with_a_retryable_read_timeout(serve):
    """Once no byte has moved for ``read_timeout`` the stall timer aborts the send, which
    becomes botocore's timeout, which the retry policy and the error mapping know."""
    stop = threading.Event()

    def stop_reading(sock: socket.socket) -> None:
        sock.recv(65536)  # the head, and then nothing more
        stop.wait(30)

    endpoint = serve(stop_reading, read_timeout=1.0)
    body = memoryview(bytes(256 * 1024 * 1024))  # far more than the socket buffers hold
    started = time.monotonic()
    try:
        with pytest.raises(bce.ReadTimeoutError) as info:
            asyncio.run(endpoint.send(body))
    finally:
        stop.set()
    assert is_retryable(info.value)
    assert 1.0 <= time.monotonic() - started < 10


def test_a_cancelled_upload_stops_at_once(serve):
    read_timeout = 60.0  # what the request would wait without the cancel
    received, release = threading.Event(), threading.Event()

    def hold(sock: socket.socket) -> None:
        read_request(sock)
        received.set()
        release.wait(2 * read_timeout)  # answer nothing

    endpoint = serve(hold, read_timeout=read_timeout)

    async def cancelled() -> float:
        task = asyncio.ensure_future(endpoint.send(b"data"))
        assert await asyncio.to_thread(received.wait, read_timeout)  # sent, waiting
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - started

    try:
        # Well under the read timeout, the one thing that ends the request without the cancel.
        assert asyncio.run(cancelled()) < read_timeout / 4
    finally:
        release.set()


def test_the_request_head_keeps_signed_headers_and_drops_expect():
    url = urlsplit("https://s3.example.com:443/bucket/key?partNumber=2&uploadId=abc")
    headers = {
        "Authorization": "AWS4-HMAC-SHA256 Credential=...",
        "X-Amz-Date": b"20260101T000000Z",
        "Expect": "100-continue",
        "Content-Length": "999",
        "User-Agent": "aiobotocore",
    }
    head = request_head("PUT", url, headers, 1234).decode("latin-1")
    lines = head.split("\r\n")
    assert lines[0] == "PUT /bucket/key?partNumber=2&uploadId=abc HTTP/1.1"
    assert "Host: s3.example.com" in lines  # the default port is not part of the signed host
    assert "Content-Length: 1234" in lines and "Content-Length: 999" not in lines
    assert "X-Amz-Date: 20260101T000000Z" in lines
    assert not any(line.lower().startswith("expect") for line in lines)
    assert head.endswith("\r\n\r\n")
    other = request_head("PUT", urlsplit("https://localhost:9000/b/k"), {}, 0).decode()
    assert "Host: localhost:9000" in other and "User-Agent: s3ckpt/" in other


def test_bodies_that_are_not_memory_are_left_to_aiohttp():
    """Bodies that are not memory (a file, say), and schemes other than HTTP(S), go the
    usual way; plain HTTP memory bodies are the data plane's as HTTPS ones are."""
    sender = BodySender(transport=None)  # type: ignore[arg-type]  # never reached
    stream = SimpleNamespace(method="PUT", url="https://h/b/k", headers={}, body=io.BytesIO())
    other = SimpleNamespace(method="PUT", url="ftp://h/b/k", headers={}, body=b"x")
    assert asyncio.run(sender(stream)) is None
    assert asyncio.run(sender(other)) is None
