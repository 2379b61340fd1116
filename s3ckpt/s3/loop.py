"""One asyncio event loop per process, on a dedicated daemon thread, owning the S3 clients.

Every transfer in a process shares this loop, its clients and its request bound, so two
checkpoints saving at once cannot oversubscribe the endpoint. The loop is keyed by pid:
after ``fork`` (DCP's process-mode ``async_save``, data-loader workers) the child gets a
fresh loop and fresh clients on first use instead of inheriting a dead thread and sockets
that belong to the parent. uvloop is used when installed.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class EventLoopThread:
    """An asyncio loop running forever on a daemon thread; submit coroutines from any thread."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = _new_event_loop()
        self._thread = threading.Thread(target=self._run, name="s3ckpt-io", daemon=True)
        self._thread.start()
        # Per-loop state (clients, semaphores) lives here so that it dies with the loop.
        self.resources: dict[Any, Any] = {}

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule ``coro`` on the loop; returns a thread-safe future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result (never call from the loop itself)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("EventLoopThread.run called from its own loop thread")
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        """Close the resources registered on the loop, then stop it."""
        if not self.loop.is_running():
            return
        with contextlib.suppress(Exception):
            self.submit(_close_resources(self.resources)).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


async def _close_resources(resources: dict[Any, Any]) -> None:
    for resource in list(resources.values()):
        closer = getattr(resource, "aclose", None)
        if closer is not None:
            await closer()
    resources.clear()


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (it sends request bodies without copying them), unless
    ``S3CKPT_EVENT_LOOP=asyncio`` asks for the standard loop."""
    if os.environ.get("S3CKPT_EVENT_LOOP", "").lower() == "asyncio":
        return asyncio.new_event_loop()
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


_lock = threading.Lock()
_current: EventLoopThread | None = None


def io_loop() -> EventLoopThread:
    """The calling process's loop, started on first use (and again in a forked child)."""
    global _current
    loop = _current
    if loop is not None and loop.pid == os.getpid():
        return loop
    with _lock:
        if _current is None or _current.pid != os.getpid():
            _current = EventLoopThread()
        return _current


def _shutdown() -> None:
    loop = _current
    if loop is not None and loop.pid == os.getpid():
        loop.close()


def _forget_after_fork() -> None:
    # The lock may have been held by another thread at fork time: replace it.
    global _lock
    _lock = threading.Lock()


atexit.register(_shutdown)
os.register_at_fork(after_in_child=_forget_after_fork)
