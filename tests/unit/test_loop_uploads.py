"""Plain-HTTP upload bodies sent from the event loop (``s3ckpt.s3.wire.on_loop``), against a
scripted server on loopback: the answer, a stale kept-alive connection, an answer that
arrives before the whole body was taken, a server that stops reading, a cancellation."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from botocore import exceptions as bce
from scripted_servers import ThreadedServer, read_request

from s3ckpt.s3.retry import is_retryable
from s3ckpt.s3.wire import on_loop
from s3ckpt.s3.wire.pool import ConnectionPool

_OK = b'HTTP/1.1 200 OK\r\nETag: "e"\r\nContent-Length: 0\r\n\r\n'


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[socket.socket], None]], ThreadedServer]]:
    servers: list[ThreadedServer] = []

    def start(handle: Callable[[socket.socket], None]) -> ThreadedServer:
        servers.append(ThreadedServer(handle))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _head(length: int) -> bytes:
    return f"PUT /b/k HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {length}\r\n\r\n".encode()


def _pool(read_timeout: float = 5.0) -> ConnectionPool:
    return ConnectionPool(verify=True, connect_timeout=5.0, read_timeout=read_timeout, max_idle=4)


def test_a_body_is_sent_whole_and_the_connection_kept(serve):
    lengths: list[int] = []

    def answer(sock: socket.socket) -> None:
        while (length := read_request(sock)) >= 0:
            lengths.append(length)
            sock.sendall(_OK)

    server = serve(answer)
    pool = _pool()
    body = memoryview(bytes(range(256)) * 40_000)  # larger than the socket buffers

    async def twice() -> list[int]:
        origin = ("http", "127.0.0.1", server.port)
        results = [
            await on_loop.send_request(pool, origin, _head(len(body)), body) for _ in range(2)
        ]
        return [status for status, _, _ in results]

    try:
        assert asyncio.run(twice()) == [200, 200]
        assert lengths == [len(body)] * 2 and server.accepted == 1  # kept alive, reused
    finally:
        pool.close_idle()
        pool.executor.shutdown(wait=True)


def test_a_kept_alive_connection_the_server_closed_is_replaced(serve):
    def answer_once(sock: socket.socket) -> None:
        read_request(sock)
        sock.sendall(_OK)  # keep-alive by default, but closed right after

    server = serve(answer_once)
    pool = _pool()

    async def twice() -> list[int]:
        origin = ("http", "127.0.0.1", server.port)
        statuses = []
        for _ in range(2):
            status, headers, _ = await on_loop.send_request(
                pool, origin, _head(4), memoryview(b"data")
            )
            assert headers["etag"] == '"e"'
            statuses.append(status)
            await asyncio.sleep(0.2)  # the server closes its side meanwhile
        return statuses

    try:
        assert asyncio.run(twice()) == [200, 200]
        assert server.accepted == 2  # the stale connection was replaced, not reported
    finally:
        pool.executor.shutdown(wait=True)


def test_an_answer_before_the_whole_body_is_what_the_caller_gets(serve):
    refusal = b"<Error><Code>AccessDenied</Code></Error>"

    def refuse_early(sock: socket.socket) -> None:
        sock.recv(65536)  # the head and no more of the body
        sock.sendall(
            b"HTTP/1.1 403 Forbidden\r\nConnection: close\r\n"
            + f"Content-Length: {len(refusal)}\r\n\r\n".encode()
            + refusal
        )
        time.sleep(0.2)

    server = serve(refuse_early)
    pool = _pool()
    body = memoryview(bytes(64 * 1024 * 1024))

    async def put() -> tuple[int, bytes]:
        origin = ("http", "127.0.0.1", server.port)
        status, _, content = await on_loop.send_request(pool, origin, _head(len(body)), body)
        return status, content

    try:
        assert asyncio.run(put()) == (403, refusal)
    finally:
        pool.executor.shutdown(wait=True)


def test_a_server_that_stops_reading_fails_with_a_retryable_read_timeout(serve):
    stop = threading.Event()

    def stop_reading(sock: socket.socket) -> None:
        sock.recv(65536)
        stop.wait(30)

    server = serve(stop_reading)
    pool = _pool(read_timeout=1.0)
    body = memoryview(bytes(256 * 1024 * 1024))

    async def put() -> None:
        origin = ("http", "127.0.0.1", server.port)
        await on_loop.send_request(pool, origin, _head(len(body)), body)

    started = time.monotonic()
    try:
        with pytest.raises(bce.ReadTimeoutError) as info:
            asyncio.run(put())
    finally:
        stop.set()
        pool.executor.shutdown(wait=True)
    assert is_retryable(info.value)
    assert 1.0 <= time.monotonic() - started < 10


def test_a_cancelled_upload_stops_at_once(serve):
    received, release = threading.Event(), threading.Event()

    def hold(sock: socket.socket) -> None:
        read_request(sock)
        received.set()
        release.wait(30)  # answer nothing

    server = serve(hold)
    pool = _pool(read_timeout=60.0)

    async def cancelled() -> float:
        origin = ("http", "127.0.0.1", server.port)
        task = asyncio.ensure_future(
            on_loop.send_request(pool, origin, _head(4), memoryview(b"data"))
        )
        assert await asyncio.to_thread(received.wait, 10)
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - started

    try:
        assert asyncio.run(cancelled()) < 5
    finally:
        release.set()
        pool.executor.shutdown(wait=True)
