"""s3ckpt.s3.wire's ranged GETs against a scripted HTTP server on loopback: every odd answer a server
can give to a ranged GET, and what the reader makes of it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from botocore import exceptions as bce
from botocore.exceptions import ClientError

from s3ckpt.s3.retry import ShortReadError
from s3ckpt.s3.wire import UnsupportedResponse, proxied
from s3ckpt.s3.wire.get_exchange import RangedGets
from s3ckpt.s3.wire.pool import ConnectionPool

OBJECT = bytes(range(256)) * 4096  # 1 MiB
Reply = Callable[[asyncio.StreamWriter, str], Awaitable[bool]]  # returns: keep the connection


def _range(request: str) -> tuple[int, int]:
    line = next(h for h in request.split("\r\n") if h.lower().startswith("range:"))
    first, last = line.split("=", 1)[1].split("-")
    return int(first), int(last) + 1


def partial(*, extra_headers: str = "", close: bool = False) -> Reply:
    async def reply(writer: asyncio.StreamWriter, request: str) -> bool:
        start, end = _range(request)
        head = (
            f"HTTP/1.1 206 Partial Content\r\nContent-Length: {end - start}\r\n"
            f"Content-Range: bytes {start}-{end - 1}/{len(OBJECT)}\r\n{extra_headers}\r\n"
        )
        writer.write(head.encode() + OBJECT[start:end])
        await writer.drain()
        return not close

    return reply


def raw(text: bytes, *, keep: bool = False) -> Reply:
    async def reply(writer: asyncio.StreamWriter, request: str) -> bool:
        writer.write(text)
        await writer.drain()
        return keep

    return reply


def stall(seconds: float) -> Reply:
    async def reply(writer: asyncio.StreamWriter, request: str) -> bool:
        start, end = _range(request)
        writer.write(
            f"HTTP/1.1 206 Partial Content\r\nContent-Length: {end - start}\r\n"
            f"Content-Range: bytes {start}-{end - 1}/{len(OBJECT)}\r\n\r\n".encode()
            + OBJECT[start : start + 10]
        )
        await writer.drain()
        await asyncio.sleep(seconds)
        return False

    return reply


class ScriptedServer:
    """Answers each request with the next scripted reply; records requests and connections."""

    def __init__(self, replies: list[Reply]) -> None:
        self.replies = list(replies)
        self.requests: list[str] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> ScriptedServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/bucket/key?X-Amz-Signature=abc"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.replies:
                head = await reader.readuntil(b"\r\n\r\n")
                request = head.decode()
                self.requests.append(request)
                if not await self.replies.pop(0)(writer, request):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


class FakeClient:
    """Stands in for the aiobotocore client: presigning is all the reader asks of it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.signed = 0

    async def generate_presigned_url(self, operation: str, **kwargs: object) -> str:
        assert operation == "get_object"
        self.signed += 1
        return self.url


class Buffer:
    """One bytearray standing for ``[start, end)``, recording the receives into it."""

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.data = bytearray(end - start)
        self.filled_at: list[tuple[int, int]] = []

    def buffer(self, offset: int) -> memoryview:
        return memoryview(self.data)[offset - self.start :]

    def filled(self, offset: int, nbytes: int) -> None:
        self.filled_at.append((offset, nbytes))


def reader(url: str, *, read_timeout: float = 5.0) -> RangedGets:
    pool = ConnectionPool(verify=True, connect_timeout=5.0, read_timeout=read_timeout, max_idle=4)
    return RangedGets(FakeClient(url), pool)


async def pull(
    direct: RangedGets, start: int, end: int, sink: Buffer, *, piece: int | None = None
) -> None:
    """Open ``[start, end)`` of bucket/key and pull its body into ``sink``, ``piece`` bytes
    at most per receive (the rest of the buffer where None)."""
    response = await direct.open("bucket", "key", start, end)
    try:
        position = start
        while position < end:
            count = await response.receive_into(sink.buffer(position)[:piece])
            sink.filled(position, count)
            position += count
    finally:
        await response.aclose()


def run(coro: Awaitable[object]) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def read_fails(
    answer: Reply,
    error: type[BaseException],
    *,
    start: int = 0,
    end: int = 10,
    match: str | None = None,
) -> BaseException:
    """A read of ``start``-``end`` from a server that gives ``answer`` raises ``error``,
    which is returned."""

    async def main() -> BaseException:
        async with ScriptedServer([answer]) as server:
            with pytest.raises(error, match=match) as caught:
                await pull(reader(server.url), start, end, Buffer(start, end))
        return caught.value

    return run(main())  # type: ignore[return-value]


def test_receives_ranges_into_the_sink_and_reuses_the_connection() -> None:
    async def main() -> None:
        async with ScriptedServer([partial(), partial()]) as server:
            direct = reader(server.url)
            for start, end in ((100, 300_000), (5, 6)):
                sink = Buffer(start, end)
                await pull(direct, start, end, sink)
                assert bytes(sink.data) == OBJECT[start:end]
                assert sum(n for _, n in sink.filled_at) == end - start
            assert server.connections == 1
            assert "Range: bytes=100-299999" in server.requests[0]
            await direct.pool.aclose()

    run(main())


def test_a_kept_alive_connection_closed_by_the_server_is_replaced_silently() -> None:
    async def main() -> None:
        # The first reply says nothing about closing, then the server closes while idle.
        async with ScriptedServer([partial(close=True), partial()]) as server:
            direct = reader(server.url)
            await pull(direct, 0, 10, Buffer(0, 10))
            await asyncio.sleep(0.05)
            sink = Buffer(10, 20)
            await pull(direct, 10, 20, sink)
            assert bytes(sink.data) == OBJECT[10:20]
            assert server.connections == 2

    run(main())


def test_connection_close_header_is_honoured() -> None:
    async def main() -> None:
        async with ScriptedServer(
            [partial(extra_headers="Connection: close\r\n"), partial()]
        ) as server:
            direct = reader(server.url)
            await pull(direct, 0, 10, Buffer(0, 10))
            await pull(direct, 0, 10, Buffer(0, 10))
            assert server.connections == 2

    run(main())


def test_a_refusal_of_a_fresh_signature_is_not_tried_again() -> None:
    denied = b"<Error><Code>AccessDenied</Code><Message>no</Message></Error>"
    head = f"HTTP/1.1 403 Forbidden\r\nContent-Length: {len(denied)}\r\n\r\n".encode()

    async def main() -> None:
        async with ScriptedServer([raw(head + denied, keep=True), partial()]) as server:
            direct = reader(server.url)
            with pytest.raises(ClientError):
                await pull(direct, 0, 10, Buffer(0, 10))
            assert direct.client.signed == 1 and len(server.requests) == 1

    run(main())


def test_error_responses_become_client_errors_with_the_s3_code() -> None:
    body = b"<?xml version='1.0'?><Error><Code>NoSuchKey</Code><Message>gone</Message></Error>"
    head = f"HTTP/1.1 404 Not Found\r\nContent-Length: {len(body)}\r\nx-amz-request-id: R1\r\n\r\n"

    async def main() -> None:
        async with ScriptedServer([raw(head.encode() + body, keep=True), partial()]) as server:
            direct = reader(server.url)
            with pytest.raises(ClientError) as caught:
                await pull(direct, 0, 10, Buffer(0, 10))
            error = caught.value.response
            assert error["Error"] == {"Code": "NoSuchKey", "Message": "gone"}
            assert error["ResponseMetadata"]["HTTPStatusCode"] == 404
            # the error body was read whole, so the connection stays usable
            await pull(direct, 0, 10, Buffer(0, 10))
            assert server.connections == 1

    run(main())


def test_error_without_a_body_uses_the_status_as_code() -> None:
    answer = raw(b"HTTP/1.1 503 Slow Down\r\nContent-Length: 0\r\n\r\n")
    error = read_fails(answer, ClientError)
    assert isinstance(error, ClientError) and error.response["Error"]["Code"] == "503"


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n",  # shorter than the range's end
        b"HTTP/1.1 206 Partial Content\r\nContent-Length: 10\r\nContent-Range: bytes 0-9/99\r\n\r\n",
    ],
    ids=["chunked", "short-object", "wrong-content-range"],
)
def test_responses_it_cannot_receive_in_place_are_reported_unsupported(head: bytes) -> None:
    read_fails(raw(head), UnsupportedResponse, start=5, end=15)


def test_a_response_cut_short_raises_short_read_after_delivering_what_came() -> None:
    head = b"HTTP/1.1 206 Partial Content\r\nContent-Length: 100\r\nContent-Range: bytes 0-99/999\r\n\r\n"

    async def main() -> None:
        async with ScriptedServer([raw(head + OBJECT[:40])]) as server:
            sink = Buffer(0, 100)
            with pytest.raises(ShortReadError):
                await pull(reader(server.url), 0, 100, sink, piece=10)
            assert sum(n for _, n in sink.filled_at) == 40
            assert bytes(sink.data[:40]) == OBJECT[:40]

    run(main())


def test_a_stalled_response_times_out() -> None:
    async def main() -> None:
        async with ScriptedServer([stall(2.0)]) as server:
            with pytest.raises(bce.ReadTimeoutError):
                await pull(reader(server.url, read_timeout=0.3), 0, 100, Buffer(0, 100))

    run(main())


def test_an_unreachable_endpoint_is_an_endpoint_connection_error() -> None:
    async def main() -> None:
        async with ScriptedServer([]) as server:
            url = server.url
        with pytest.raises(bce.EndpointConnectionError):
            await pull(reader(url), 0, 10, Buffer(0, 10))

    run(main())


def test_proxies_from_the_environment_are_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert not proxied("http://127.0.0.1:9000")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    assert proxied("http://flashblade.example:80")
    assert not proxied("https://flashblade.example")
    monkeypatch.setenv("NO_PROXY", "flashblade.example")
    assert not proxied("http://flashblade.example:80")


def test_one_signature_serves_every_range_and_a_refused_one_is_renewed() -> None:
    denied = b"<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>"
    head = f"HTTP/1.1 403 Forbidden\r\nContent-Length: {len(denied)}\r\n\r\n".encode()

    async def main() -> None:
        async with ScriptedServer(
            [partial(), partial(), raw(head + denied, keep=True), partial()]
        ) as s:
            direct = reader(s.url)
            for start in (0, 10, 20):
                sink = Buffer(start, start + 10)
                await pull(direct, start, start + 10, sink)
                assert bytes(sink.data) == OBJECT[start : start + 10]
            assert direct.client.signed == 2  # once, then again after the 403

    run(main())


def _chunked(body: bytes, pieces: int = 3) -> bytes:
    size = -(-len(body) // pieces)
    chunks = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


SLOWDOWN = (
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
)


def test_a_chunked_error_on_a_kept_alive_connection_is_read_at_once_and_reused() -> None:
    """AWS-style errors come chunked on kept-alive connections: waiting for the server to
    close would stall the load for minutes."""
    head = b"HTTP/1.1 503 Slow Down\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def main() -> None:
        async with ScriptedServer([raw(head + _chunked(SLOWDOWN), keep=True), partial()]) as s:
            direct = reader(s.url, read_timeout=30.0)
            started = asyncio.get_running_loop().time()
            with pytest.raises(ClientError) as caught:
                await pull(direct, 0, 10, Buffer(0, 10))
            assert asyncio.get_running_loop().time() - started < 2.0
            assert caught.value.response["Error"]["Code"] == "SlowDown"
            sink = Buffer(0, 10)
            await pull(direct, 0, 10, sink)
            assert bytes(sink.data) == OBJECT[:10] and s.connections == 1

    run(main())


def test_a_close_delimited_error_body_ends_with_the_connection() -> None:
    head = b"HTTP/1.1 500 Internal Server Error\r\nConnection: close\r\n\r\n"
    body = b"<Error><Code>InternalError</Code><Message>x</Message></Error>"

    async def main() -> None:
        async with ScriptedServer([raw(head + body), partial()]) as s:
            direct = reader(s.url)
            with pytest.raises(ClientError) as caught:
                await pull(direct, 0, 10, Buffer(0, 10))
            assert caught.value.response["Error"]["Code"] == "InternalError"
            await pull(direct, 0, 10, Buffer(0, 10))
            assert s.connections == 2  # the first was closed with the response

    run(main())


def test_interim_100_continue_responses_are_skipped() -> None:
    async def main() -> None:
        interim = raw(b"HTTP/1.1 100 Continue\r\n\r\n", keep=True)

        async def both(writer: asyncio.StreamWriter, request: str) -> bool:
            await interim(writer, request)
            return await partial()(writer, request)

        async with ScriptedServer([both]) as s:
            sink = Buffer(3, 40)
            await pull(reader(s.url), 3, 40, sink)
            assert bytes(sink.data) == OBJECT[3:40]

    run(main())


def test_a_redirect_is_handed_to_aiobotocore() -> None:
    body = b"<Error><Code>TemporaryRedirect</Code><Message>elsewhere</Message></Error>"
    head = (
        f"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://other.invalid/bucket/key\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()

    read_fails(raw(head + body, keep=True), UnsupportedResponse, match="redirect 307")


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 503 Slow Down\r\nContent-Length: 500\r\n\r\n<Error>",  # cut short
        b"HTTP/1.1 503 Slow Down\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n<Error>",
    ],
    ids=["content-length", "chunked"],
)
def test_an_error_body_cut_short_is_a_connection_error(reply: bytes) -> None:
    read_fails(raw(reply), ConnectionError)


def test_a_content_length_that_does_not_match_the_range_is_not_received_in_place() -> None:
    head = (
        b"HTTP/1.1 206 Partial Content\r\nContent-Length: 9\r\nContent-Range: bytes 0-9/99\r\n\r\n"
    )

    read_fails(raw(head + OBJECT[:9]), UnsupportedResponse)


def test_a_server_ignoring_range_has_the_range_cut_from_the_whole_object(caplog) -> None:
    """200 with the whole object: the bytes before the range are dropped, the range lands
    in the sink, and the connection is closed instead of reading the rest."""
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(OBJECT)}\r\n\r\n".encode()

    async def main() -> None:
        async with ScriptedServer([raw(head + OBJECT, keep=True), partial()]) as s:
            direct = reader(s.url)
            sink = Buffer(300_000, 300_100)
            await pull(direct, 300_000, 300_100, sink)
            assert bytes(sink.data) == OBJECT[300_000:300_100]
            await pull(direct, 0, 10, Buffer(0, 10))
            assert s.connections == 2

    with caplog.at_level("WARNING"):
        run(main())
    assert "ignores Range" in caplog.text
