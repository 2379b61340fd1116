"""One ranged GET as its reader pulls it, resumed across failed tries out of the reader's sight.

:meth:`~s3ckpt.s3.store.ObjectStore.open_range` gives a :class:`RangedRead`; the reader
owns the loop and asks for the next bytes into memory it names
(:meth:`RangedRead.receive_into`). A try that fails (a dropped connection, a stall, a
response that ends early) is retried under the request's one retry budget
(:meth:`~s3ckpt.s3.requests.Requests.retrying`), asking only for the bytes from the first
one not yet delivered, so the reader sees every byte of the range once, in order, and
never a retry.
"""

from __future__ import annotations

import contextlib

from s3ckpt.s3.requests import Requests, Retrying
from s3ckpt.s3.wire import RangeBody


class RangedRead:
    """Bytes ``[start, end)`` of ``key``, pulled by :meth:`receive_into`; each try a
    :meth:`~s3ckpt.s3.requests.Requests.range_try` under ``tries``."""

    def __init__(self, requests: Requests, tries: Retrying, key: str, start: int, end: int) -> None:
        self.requests = requests
        self.tries = tries
        self.key = key
        self.end = end
        self.position = start  # the first byte not yet delivered: where a retry resumes
        self._body: RangeBody | None = None
        self._try: contextlib.AsyncExitStack | None = None

    async def open(self) -> None:
        """Send the first try and read its head (retried like any try)."""
        while True:
            try:
                await self._begin()
                return
            except Exception as exc:
                await self._end(exc)
                await self.tries.failed(exc)

    async def receive_into(self, view: memoryview) -> int:
        """Receive the next bytes of the range into ``view``: the count, ``len(view)``
        unless the range ends first (0 once it is in)."""
        view = view[: self.end - self.position]
        while view:
            try:
                body = self._body if self._body is not None else await self._begin()
                count = await body.receive_into(view)
            except Exception as exc:
                await self._end(exc)
                await self.tries.failed(exc)
                continue
            self.position += count
            if self.position == self.end:
                await self._end(None)
            return count
        return 0

    async def close(self, error: BaseException | None) -> None:
        """End the try under way, with the ``error`` the reader stopped on, if any."""
        await self._end(error)

    async def _begin(self) -> RangeBody:
        """A new try from :attr:`position`: its body, the head read."""
        stack = contextlib.AsyncExitStack()
        self._body = await stack.enter_async_context(
            self.requests.range_try(self.key, self.position, self.end, self.tries)
        )
        self._try = stack
        return self._body

    async def _end(self, error: BaseException | None) -> None:
        """Close the try under way (if any), telling it the ``error`` it ended with."""
        stack, self._try, self._body = self._try, None, None
        if stack is not None:
            if error is None:
                await stack.aclose()
            else:
                await stack.__aexit__(type(error), error, error.__traceback__)
