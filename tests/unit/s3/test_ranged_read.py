"""RangedRead: a ranged GET its reader pulls, each failed try resumed out of its sight."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from s3ckpt.s3.ranged_read import RangedRead
from s3ckpt.s3.retry import ShortReadError

OBJECT = bytes(range(256)) * 4


class _Try:
    """One try's body: bytes from ``start`` on, cut short after ``cut`` of them."""

    def __init__(self, start: int, cut: int | None) -> None:
        self.position, self.cut = start, cut

    async def receive_into(self, view: memoryview) -> int:
        if self.cut is not None and len(view) > self.cut:
            view[: self.cut] = OBJECT[self.position : self.position + self.cut]
            raise ShortReadError("the connection closed")
        if self.cut is not None:
            self.cut -= len(view)
        view[:] = OBJECT[self.position : self.position + len(view)]
        self.position += len(view)
        return len(view)


class _Requests:
    """Tries whose bodies are cut short after ``cuts[i]`` bytes (None: never)."""

    def __init__(self, cuts: list[int | None]) -> None:
        self.cuts = cuts
        self.opened: list[tuple[int, int]] = []
        self.ended: list[BaseException | None] = []
        self.under: list[_Tries] = []  # the tries each try was made among

    @contextlib.asynccontextmanager
    async def range_try(self, key: str, start: int, end: int, tries: _Tries) -> AsyncIterator[_Try]:
        self.opened.append((start, end))
        self.under.append(tries)
        try:
            yield _Try(start, self.cuts[len(self.opened) - 1])
        except BaseException as exc:
            self.ended.append(exc)
            raise
        self.ended.append(None)


class _Tries:
    def __init__(self, limit: int) -> None:
        self.failures: list[Exception] = []
        self.limit = limit

    async def failed(self, failure: Exception) -> None:
        self.failures.append(failure)
        if len(self.failures) >= self.limit:
            raise failure


def _pull(requests: _Requests, tries: _Tries, start: int, end: int, piece: int) -> bytes:
    data = memoryview(bytearray(end - start))

    async def main() -> None:
        read = RangedRead(requests, tries, "k", start, end)  # type: ignore[arg-type]
        await read.open()
        done = 0
        while done < len(data):
            done += await read.receive_into(data[done : done + piece])
        assert await read.receive_into(memoryview(bytearray(1))) == 0  # the range is in
        await read.close(None)

    asyncio.run(main())
    return bytes(data)


def test_a_try_cut_short_resumes_at_the_first_byte_not_delivered() -> None:
    requests, tries = _Requests([250, 30, None]), _Tries(limit=5)
    assert _pull(requests, tries, 100, 900, piece=100) == OBJECT[100:900]
    # 200 bytes delivered before the first cut (the 50 of the third receive were not),
    # then none of the second try's 30: each try asks for the bytes from there on.
    assert requests.opened == [(100, 900), (300, 900), (300, 900)]
    assert [type(e) for e in tries.failures] == [ShortReadError, ShortReadError]
    assert [type(e) if e else None for e in requests.ended] == [ShortReadError] * 2 + [None]
    assert requests.under == [tries] * 3  # every try among the read's one request's tries


def test_a_read_out_of_tries_raises_the_last_failure() -> None:
    requests, tries = _Requests([10, 10, 10]), _Tries(limit=3)
    with pytest.raises(ShortReadError):
        _pull(requests, tries, 0, 100, piece=50)
    assert len(requests.opened) == 3 and len(tries.failures) == 3
