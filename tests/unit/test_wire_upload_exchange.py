"""The data plane's upload pieces on their own, over TLS: request heads as signed,
cancellation, stale kept-alive connections, answers that arrive before the whole body was
taken."""

from __future__ import annotations

import asyncio
import io
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
from scripted_servers import ThreadedServer, read_request

from s3ckpt.s3.wire.exchange import send_request
from s3ckpt.s3.wire.pool import ConnectionPool
from s3ckpt.s3.wire.uploads import BodySender, request_head
from s3ckpt.testing.tls_cert import write_tls_files


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


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[[Callable[[ssl.SSLSocket], None]], _TlsServer]]:
    servers: list[_TlsServer] = []

    def start(handle: Callable[[ssl.SSLSocket], None]) -> _TlsServer:
        directory = tmp_path / str(len(servers))
        directory.mkdir()
        servers.append(_TlsServer(directory, handle))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


class _TlsServer(ThreadedServer):
    """A :class:`ThreadedServer` over TLS, with a CA and certificate made in ``directory``."""

    def __init__(self, directory: Path, handle: Callable[[ssl.SSLSocket], None]) -> None:
        files = write_tls_files(directory)
        self.ca_file = files.ca_file
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(files.cert_file, files.key_file)
        super().__init__(handle, context)  # type: ignore[arg-type]


def _transport(ca_file: Path, read_timeout: float = 5.0) -> ConnectionPool:
    return ConnectionPool(
        verify=str(ca_file), connect_timeout=5.0, read_timeout=read_timeout, max_idle=4
    )


_OK = b'HTTP/1.1 200 OK\r\nETag: "e"\r\nContent-Length: 0\r\n\r\n'


def test_a_cancelled_request_stops_its_thread_at_once(serve):
    read_timeout = 60.0  # what the request would wait without the cancel
    received, release = threading.Event(), threading.Event()

    def hold(sock: ssl.SSLSocket) -> None:
        read_request(sock)
        received.set()
        release.wait(2 * read_timeout)  # answer nothing

    server = serve(hold)
    transport = _transport(server.ca_file, read_timeout=read_timeout)
    head = b"PUT /b/k HTTP/1.1\r\nHost: localhost\r\nContent-Length: 4\r\n\r\n"

    async def cancelled() -> float:
        task = asyncio.ensure_future(
            transport.run(
                ("https", "localhost", server.port),
                lambda c: send_request(c, head, memoryview(b"data")),
            )
        )
        # The request is sent and its thread waits for the answer.
        assert await asyncio.to_thread(received.wait, read_timeout)
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
        transport.executor.shutdown(wait=True)


def test_a_kept_alive_connection_the_server_closed_is_replaced(serve):
    closed = threading.Event()

    def answer_once(sock: ssl.SSLSocket) -> None:
        read_request(sock)
        sock.sendall(_OK)  # keep-alive by default, but close it right after
        sock.close()
        closed.set()

    server = serve(answer_once)
    transport = _transport(server.ca_file)
    head = b"PUT /b/k HTTP/1.1\r\nHost: localhost\r\nContent-Length: 4\r\n\r\n"

    async def twice() -> list[int]:
        statuses = []
        for _ in range(2):
            status, headers, _ = await transport.run(
                ("https", "localhost", server.port),
                lambda c: send_request(c, head, memoryview(b"data")),
            )
            statuses.append(status)
            assert headers["etag"] == '"e"'
            assert await asyncio.to_thread(closed.wait, 10)  # the idle connection is closed
            closed.clear()
        return statuses

    try:
        assert asyncio.run(twice()) == [200, 200]
        assert server.accepted == 2  # the stale connection was replaced, not reported
    finally:
        transport.close_idle()
        transport.executor.shutdown(wait=True)


def test_an_answer_before_the_whole_body_is_what_the_caller_gets(serve):
    refusal = b"<Error><Code>AccessDenied</Code></Error>"

    def refuse_early(sock: ssl.SSLSocket) -> None:
        sock.recv(65536)  # the head and no more of the body
        sock.sendall(
            b"HTTP/1.1 403 Forbidden\r\nConnection: close\r\n"
            + f"Content-Length: {len(refusal)}\r\n\r\n".encode()
            + refusal
        )
        time.sleep(0.5)

    server = serve(refuse_early)
    transport = _transport(server.ca_file)
    body = memoryview(bytes(64 * 1024 * 1024))
    head = f"PUT /b/k HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(body)}\r\n\r\n".encode()

    async def put() -> tuple[int, bytes]:
        status, _, content = await transport.run(
            ("https", "localhost", server.port), lambda c: send_request(c, head, body)
        )
        return status, content

    try:
        assert asyncio.run(put()) == (403, refusal)
    finally:
        transport.executor.shutdown(wait=True)


def test_bodies_that_are_not_memory_are_left_to_aiohttp():
    """Bodies that are not memory (a file, say), and schemes other than HTTP(S), go the
    usual way; plain HTTP memory bodies are the data plane's as HTTPS ones are."""
    sender = BodySender(transport=None)  # type: ignore[arg-type]  # never reached
    stream = SimpleNamespace(method="PUT", url="https://h/b/k", headers={}, body=io.BytesIO())
    other = SimpleNamespace(method="PUT", url="ftp://h/b/k", headers={}, body=b"x")
    assert asyncio.run(sender(stream)) is None
    assert asyncio.run(sender(other)) is None


def test_a_send_that_stalls_is_a_retryable_read_timeout(serve):
    """A server that stops reading the body: once no byte has moved for ``read_timeout``
    the stall timer aborts the send, which becomes botocore's timeout, which the retry
    policy and the error mapping know."""
    from botocore import exceptions as bce

    from s3ckpt.s3.retry import is_retryable

    stop = threading.Event()

    def stop_reading(sock: ssl.SSLSocket) -> None:
        sock.recv(65536)  # the head, and then nothing more
        stop.wait(30)

    server = serve(stop_reading)
    transport = _transport(server.ca_file, read_timeout=1.0)
    body = memoryview(bytes(256 * 1024 * 1024))  # far more than the socket buffers hold
    head = f"PUT /b/k HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(body)}\r\n\r\n"

    async def put() -> None:
        await transport.run(
            ("https", "localhost", server.port), lambda c: send_request(c, head.encode(), body)
        )

    started = time.monotonic()
    try:
        with pytest.raises(bce.ReadTimeoutError) as info:
            asyncio.run(put())
    finally:
        stop.set()
        transport.executor.shutdown(wait=True)
    assert is_retryable(info.value)
    assert 1.0 <= time.monotonic() - started < 10
