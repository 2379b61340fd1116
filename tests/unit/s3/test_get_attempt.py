"""The aiobotocore path of ranged reads (``get_attempt.stream``) against servers that
answer a ranged GET with something other than the range."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from s3ckpt.errors import StorageError
from s3ckpt.s3 import get_attempt

OBJECT = bytes(range(256)) * 64  # 16 KiB


class _Content:
    def __init__(self, body: bytes, chunk: int) -> None:
        self.pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)]

    async def readchunk(self) -> tuple[bytes, bool]:
        return (self.pieces.pop(0) if self.pieces else b""), False


class _Body:
    def __init__(self, body: bytes, chunk: int) -> None:
        self.raw_stream = type("Raw", (), {"content": _Content(body, chunk)})()

    async def __aenter__(self) -> _Body:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


class _Client:
    def __init__(self, status: int, body: bytes, content_range: str | None) -> None:
        self.status, self.body, self.content_range = status, body, content_range

    async def get_object(self, **params: Any) -> dict[str, Any]:
        response: dict[str, Any] = {
            "ResponseMetadata": {"HTTPStatusCode": self.status},
            "Body": _Body(self.body, 1000),
        }
        if self.content_range is not None:
            response["ContentRange"] = self.content_range
        return response


class _Sink:
    def __init__(self, start: int, end: int) -> None:
        self.start, self.data = start, bytearray(end - start)

    def buffer(self, offset: int) -> memoryview:
        return memoryview(self.data)[offset - self.start :]

    def filled(self, offset: int, nbytes: int) -> None:
        pass


def _stream(client: _Client, start: int, end: int) -> bytes:
    sink = _Sink(start, end)
    asyncio.run(get_attempt.stream(client, "http://127.0.0.1:9", "bucket", "key", start, end, sink))
    return bytes(sink.data)


def test_a_whole_object_for_a_ranged_get_is_cut_to_the_range(caplog) -> None:
    with caplog.at_level("WARNING"):
        got = _stream(_Client(200, OBJECT, None), 4321, 9876)
    assert got == OBJECT[4321:9876]
    assert "ignores Range" in caplog.text


def test_a_partial_response_lands_at_its_offset() -> None:
    client = _Client(206, OBJECT[100:200], f"bytes 100-199/{len(OBJECT)}")
    assert _stream(client, 100, 200) == OBJECT[100:200]


def test_a_response_for_bytes_after_the_range_start_is_refused() -> None:
    client = _Client(206, OBJECT[150:200], f"bytes 150-199/{len(OBJECT)}")
    with pytest.raises(StorageError, match="answered bytes"):
        _stream(client, 100, 200)
