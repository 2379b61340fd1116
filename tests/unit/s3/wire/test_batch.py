"""The native batch sender (``s3ckpt.s3.wire._sender`` and ``s3ckpt.s3.wire.batch``)
against scripted servers on loopback: answers read whole, kept-alive connections reused
and replaced when the server closed them, every failure reported as the data plane
reports it (a retryable drop, a read timeout, a refused connection), answers it does not
read left to the usual path, cancellation, and the GIL left alone while it works."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import sys
import threading
import time
from urllib.parse import urlsplit

import pytest
from botocore import exceptions as bce
from scripted_servers import ThreadedServer, read_request

from s3ckpt.s3.wire import batch as native

pytestmark = pytest.mark.skipif(
    not native.native_batches(), reason="the C extension s3ckpt.s3.wire._sender is not built"
)
_sender = native._sender


def _ok(tag: int) -> bytes:
    return f'HTTP/1.1 200 OK\r\nETag: "e{tag}"\r\nContent-Length: 0\r\n\r\n'.encode()


def _request(n: int, body: bytes) -> tuple[bytes, memoryview]:
    head = f"PUT /b/k?partNumber={n} HTTP/1.1\r\nHost: s3\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode(), memoryview(body)


def _serve(handle) -> ThreadedServer:
    return ThreadedServer(handle)


def _exchange(server: ThreadedServer, requests, connections=2, timeout=5.0, cancel=None):
    return _sender.exchange("127.0.0.1", server.port, requests, connections, 5.0, timeout, cancel)


def test_every_body_arrives_whole_and_every_answer_is_read_on_kept_alive_connections():
    received: list[int] = []
    lock = threading.Lock()

    def handle(sock: socket.socket) -> None:
        while (length := read_request(sock)) >= 0:
            with lock:
                received.append(length)
                tag = len(received)
            sock.sendall(_ok(tag))

    server = _serve(handle)
    try:
        bodies = [bytes([n]) * (1 << 20) * (n + 1) for n in range(6)]
        results = _exchange(server, [_request(n, b) for n, b in enumerate(bodies)])
    finally:
        server.close()
    assert sorted(received) == sorted(len(b) for b in bodies)
    assert [code for code, _ in results] == [0] * 6
    parsed = [native.outcome(code, answer, "http://x") for code, answer in results]
    assert all(status == 200 and headers["etag"].startswith('"e') for status, headers, _ in parsed)
    assert server.accepted == 2  # one connection per thread, kept for its requests


def test_an_error_answer_comes_back_with_its_document():
    document = b"<Error><Code>SlowDown</Code><Message>Reduce your rate.</Message></Error>"

    def handle(sock: socket.socket) -> None:
        while read_request(sock) >= 0:
            head = f"HTTP/1.1 503 Slow Down\r\nContent-Length: {len(document)}\r\n\r\n"
            sock.sendall(head.encode() + document)

    server = _serve(handle)
    try:
        [(code, answer)] = _exchange(server, [_request(1, b"x" * 1000)])
    finally:
        server.close()
    status, _, body = native.outcome(code, answer, "http://x")
    assert (status, body) == (503, document)


def test_a_connection_the_server_closed_after_answering_is_replaced():
    """An answer without ``Connection: close``, then the server closes: the next request on
    that connection fails before any answer and is sent again on a new one."""

    def handle(sock: socket.socket) -> None:
        if read_request(sock) >= 0:
            sock.sendall(_ok(1))

    server = _serve(handle)
    try:
        results = _exchange(server, [_request(n, b"y" * 100_000) for n in range(4)], 1)
    finally:
        server.close()
    assert [code for code, _ in results] == [0] * 4
    assert server.accepted == 4


def test_a_connection_dropped_mid_body_is_a_retryable_connection_error():
    def handle(sock: socket.socket) -> None:
        sock.recv(1000)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")

    server = _serve(handle)
    try:
        [(code, message)] = _exchange(server, [_request(1, b"z" * (32 << 20))], 1)
    finally:
        server.close()
    failure = native.outcome(code, message, "http://x")
    assert isinstance(failure, ConnectionError), failure


def test_a_server_that_stops_answering_is_a_read_timeout():
    release = threading.Event()

    def handle(sock: socket.socket) -> None:
        read_request(sock)
        release.wait(10)

    server = _serve(handle)
    started = time.monotonic()
    try:
        [(code, message)] = _exchange(server, [_request(1, b"s" * 1000)], 1, timeout=0.5)
    finally:
        release.set()
        server.close()
    assert 0.4 < time.monotonic() - started < 5
    assert code == errno.ETIMEDOUT
    assert isinstance(native.outcome(code, message, "http://x"), bce.ReadTimeoutError)


def test_a_refused_connection_is_an_endpoint_connection_error():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    [(code, message)] = _sender.exchange("127.0.0.1", port, [_request(1, b"r")], 1, 2.0, 2.0, None)
    failure = native.outcome(code, message, f"http://127.0.0.1:{port}")
    assert isinstance(failure, bce.EndpointConnectionError)
    assert f"127.0.0.1:{port}" in str(failure)


def test_a_chunked_answer_is_left_to_the_usual_path():
    def handle(sock: socket.socket) -> None:
        while read_request(sock) >= 0:
            sock.sendall(
                b"HTTP/1.1 503 Slow Down\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"5\r\nhello\r\n0\r\n\r\n"
            )

    server = _serve(handle)
    try:
        [(code, message)] = _exchange(server, [_request(1, b"c")], 1)
    finally:
        server.close()
    assert isinstance(native.outcome(code, message, "http://x"), native.NotSent)


def test_cancelled_requests_are_not_sent():
    seen: list[int] = []

    def handle(sock: socket.socket) -> None:
        while (length := read_request(sock)) >= 0:
            seen.append(length)
            sock.sendall(_ok(1))

    server = _serve(handle)
    try:
        results = _exchange(
            server, [_request(n, b"q") for n in range(3)], 1, cancel=bytearray(b"\x01")
        )
    finally:
        server.close()
    assert seen == []
    assert all(isinstance(native.outcome(c, m, "http://x"), native.NotSent) for c, m in results)


def test_a_cancelled_batch_waits_for_its_requests_on_the_wire():
    """Cancelling the task skips what has not started and returns only once nothing of the
    batch can still reach the server (the clean-up that follows aborts the upload)."""
    answered: list[float] = []
    first = threading.Event()

    def handle(sock: socket.socket) -> None:
        while read_request(sock) >= 0:
            first.set()
            time.sleep(0.5)
            answered.append(time.monotonic())
            sock.sendall(_ok(1))

    class Pool:
        connect_timeout = read_timeout = 5.0
        executor = None

    server = _serve(handle)

    async def cancel_mid_batch() -> float:
        url = urlsplit(f"http://127.0.0.1:{server.port}/b/k")
        task = asyncio.ensure_future(
            native.NativeBatch(Pool()).send(url, [_request(n, b"w") for n in range(5)], 1)
        )
        await asyncio.get_running_loop().run_in_executor(None, first.wait, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic()

    try:
        returned = asyncio.run(cancel_mid_batch())
    finally:
        server.close()
    assert len(answered) == 1 and answered[0] <= returned  # one on the wire, none after


def test_the_gil_is_free_while_a_batch_is_on_the_wire():
    """A Python thread counts while a batch of slow answers is in flight: it runs freely."""

    def handle(sock: socket.socket) -> None:
        while read_request(sock) >= 0:
            time.sleep(0.3)
            sock.sendall(_ok(1))

    server = _serve(handle)
    done = threading.Event()
    counted = [0]

    def count() -> None:
        while not done.is_set():
            counted[0] += 1

    try:
        counter = threading.Thread(target=count)
        counter.start()
        time.sleep(0.05)
        before = counted[0]
        _exchange(server, [_request(n, b"g" * 1000) for n in range(2)], 2)
        during = counted[0] - before
        done.set()
        counter.join()
    finally:
        done.set()
        server.close()
    assert during > 100_000  # a thread holding the GIL for 0.3 s would leave it near zero


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        _sender.exchange("127.0.0.1", 1, [], 0, 1.0, 1.0, None)
    with pytest.raises(TypeError):
        _sender.exchange("127.0.0.1", 1, [b"not a pair"], 1, 1.0, 1.0, None)


def test_batches_taking_several_request_slots_never_wait_on_each_other():
    """Batches that each want most of the slots, and single requests beside them, all
    finish: one taker at a time gathers several slots, so no two hold some and wait."""
    from s3ckpt.config import S3Config
    from s3ckpt.s3.client import ClientHandle

    handle = ClientHandle(S3Config(max_concurrency=4))
    peak = [0, 0]  # in use now, most ever

    async def hold(count: int) -> None:
        async with handle.slots_for(count):
            peak[0] += count
            peak[1] = max(peak)
            await asyncio.sleep(0.01)
            peak[0] -= count

    async def single() -> None:
        async with handle.slots:
            peak[0] += 1
            peak[1] = max(peak)
            await asyncio.sleep(0.005)
            peak[0] -= 1

    async def crowd() -> None:
        await asyncio.wait_for(
            asyncio.gather(*(hold(3) for _ in range(6)), *(single() for _ in range(10))), 10
        )

    asyncio.run(crowd())
    assert peak[1] <= 4


def _nice_values() -> dict[int, int]:
    """Each thread of this process and its nice value (``/proc/self/task/*/stat``)."""
    values = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        values[int(task)] = int(fields[16])
    return values


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values: Linux")
@pytest.mark.parametrize(("variable", "expected"), [(None, 19), ("5", 5), ("junk", 19)])
def test_the_sender_threads_yield_the_core_to_the_threads_that_hold_the_gil(
    monkeypatch, variable, expected
):
    """The threads the sender starts run at nice 19, the normal class's lowest priority
    (or ``$S3CKPT_SENDER_NICE``), so that a Python thread holding the GIL is not kept off
    the core by them; the calling thread (a Python thread that holds the GIL for other
    work, and could not lower its nice value again) keeps its priority and only waits."""
    if variable is None:
        monkeypatch.delenv("S3CKPT_SENDER_NICE", raising=False)
    else:
        monkeypatch.setenv("S3CKPT_SENDER_NICE", variable)
    seen: list[dict[int, int]] = []
    server_threads: set[int] = set()
    lock = threading.Lock()

    def handle(sock: socket.socket) -> None:
        with lock:
            server_threads.add(threading.get_native_id())
        while read_request(sock) >= 0:
            time.sleep(0.05)  # every sender thread started meanwhile
            with lock:
                seen.append(_nice_values())  # the sender threads wait for these answers
            sock.sendall(_ok(1))

    caller: dict[str, int] = {}

    def call() -> None:
        caller["tid"] = threading.get_native_id()
        caller["before"] = os.getpriority(os.PRIO_PROCESS, 0)
        caller["codes"] = [code for code, _ in _exchange(server, requests, connections=2)]
        caller["after"] = os.getpriority(os.PRIO_PROCESS, 0)

    requests = [_request(n, b"x" * 1000) for n in range(4)]
    server = _serve(handle)
    before = set(_nice_values())  # the server's own threads included
    try:
        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
    finally:
        server.close()
    assert caller["codes"] == [0] * 4
    assert caller["after"] == caller["before"] < expected
    others = before | server_threads | {caller["tid"]}
    senders: dict[int, int] = {}
    for values in seen:  # a thread is seen at its latest (a nice value only goes up)
        senders.update((tid, nice) for tid, nice in values.items() if tid not in others)
    assert len(senders) == 2 and set(senders.values()) == {expected}
