"""Ranged reads answered from bytes in memory, as :meth:`ObjectStore.open_range` answers
them: each receive fills the memory it names from where the last one ended."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable


class PayloadRange:
    """Bytes ``[start, end)`` of ``payload`` (an object's bytes), pulled receive by
    receive; :attr:`receives` records each receive's length."""

    def __init__(self, payload: bytes, start: int, end: int) -> None:
        self.payload = payload
        self.position = start
        self.end = end
        self.receives: list[int] = []

    async def receive_into(self, view: memoryview) -> int:
        count = min(len(view), self.end - self.position)
        view[:count] = self.payload[self.position : self.position + count]
        self.position += count
        self.receives.append(count)
        return count


class PayloadStore:
    """A store whose ranged reads come from ``payload(key)``; :attr:`opened` records the
    ranges asked for, in order."""

    def __init__(self, payload: Callable[[str], bytes]) -> None:
        self.payload = payload
        self.opened: list[tuple[str, int, int]] = []

    @contextlib.asynccontextmanager
    async def open_range(self, key: str, start: int, end: int) -> AsyncIterator[PayloadRange]:
        self.opened.append((key, start, end))
        yield PayloadRange(self.payload(key), start, end)
