"""The stall timer: a request whose connection moves no byte for ``read_timeout`` fails.

Sockets carry no timeout of their own (with one, every blocking TLS record read would
poll first); instead one timer per request on the event loop compares the connection's
last progress with the clock, and stops a stalled request: its socket shut down, so a
blocking call ends, and the exchange raises botocore's ``ReadTimeoutError``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from s3ckpt.s3.wire.connection import Connection


class StallTimer:
    """Calls ``on_stall(connection)`` once no byte has moved on the watched connection for
    ``timeout`` seconds. ``watched()`` is the connection, or None while there is none yet
    (connecting is not watched: it has its own timeout)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        watched: Callable[[], Connection | None],
        timeout: float,
        on_stall: Callable[[Connection], None],
    ) -> None:
        self.loop = loop
        self.watched = watched
        self.timeout = timeout
        self.on_stall = on_stall
        self.handle: asyncio.TimerHandle | None = loop.call_later(timeout, self._check)

    def _check(self) -> None:
        connection = self.watched()
        now = time.monotonic()
        if connection is not None and now - connection.progress >= self.timeout:
            self.handle = None
            self.on_stall(connection)
            return
        since = now - connection.progress if connection is not None else 0.0
        self.handle = self.loop.call_later(max(self.timeout - since, 0.01), self._check)

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


def abort_stalled(connection: Connection) -> None:
    """A blocking exchange that stalled: its call ends, and it raises the read timeout."""
    connection.timed_out = True
    connection.abort()
