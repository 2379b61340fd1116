"""The aiobotocore path of ranged reads (``get_attempt.open_range``) against servers that
answer a ranged GET with something other than the range."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from s3ckpt.errors import StorageError
from s3ckpt.s3 import get_attempt, retry

OBJECT = bytes(range(256)) * 64  # 16 KiB


class _Content:
    def __init__(self, body: bytes, chunk: int) -> None:
        self.pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)]

    async def readchunk(self) -> tuple[bytes, bool]:
        return (self.pieces.pop(0) if self.pieces else b""), False


class _Body:
    def __init__(self, body: bytes, chunk: int) -> None:
        self.raw_stream = type("Raw", (), {"content": _Content(body, chunk)})()
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


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


def _stream(client: _Client, start: int, end: int, piece: int | None = None) -> bytes:
    """Bytes ``[start, end)`` pulled through one try, ``piece`` bytes per receive at most."""
    data = memoryview(bytearray(end - start))

    async def pull() -> None:
        body = await get_attempt.open_range(client, "http://127.0.0.1:9", "b", "k", start, end)
        try:
            done = 0
            while done < len(data):
                done += await body.receive_into(data[done:][:piece])
        finally:
            await body.aclose()

    asyncio.run(pull())
    return bytes(data)


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


def test_a_received_chunk_is_split_across_the_memory_receives_name() -> None:
    client = _Client(206, OBJECT[0:2500], f"bytes 0-2499/{len(OBJECT)}")  # 1000-byte chunks
    assert _stream(client, 0, 2500, piece=300) == OBJECT[:2500]


def test_a_response_that_ends_early_is_a_short_read() -> None:
    client = _Client(206, OBJECT[100:150], f"bytes 100-199/{len(OBJECT)}")
    with pytest.raises(retry.ShortReadError, match="after 50 of 100 bytes"):
        _stream(client, 100, 200)
