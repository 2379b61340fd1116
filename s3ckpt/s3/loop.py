"""Where s3ckpt's coroutines run: one asyncio event loop per process, on a dedicated daemon
thread, owning the S3 clients; and many requests run on it at once under a bound.

Every transfer in a process shares this loop, its clients and its request bound, so two
checkpoints saving at once cannot oversubscribe the endpoint. The loop is keyed by pid:
after ``fork`` (DCP's process-mode ``async_save``, data-loader workers) the child gets a
fresh loop and fresh clients on first use instead of inheriting a dead thread and sockets
that belong to the parent. uvloop is used when installed.

A :class:`CancelScope` lets another thread stop what a thread waits for on the loop (the
CLI's ``--timeout``): the scope's tasks are cancelled on the loop, and the thread's waits
raise the scope's error once they have ended, so the error comes out of a request, where
every caller expects errors, never out of whatever line the thread was running.

:func:`bounded` is the fan-out every batch of requests uses. A listing of folders, the
manifests of many checkpoints, a load's rank indexes, batches of deletes: each is a set of
independent requests whose results are all needed. They run concurrently, at most
``limit`` at a time, and the first failure cancels the rest and waits for them, so nothing
keeps reading or deleting after an error has been reported. :func:`settled` runs every
one whatever the others do, for clean-ups.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from concurrent.futures import Future
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_LIMIT = 8  # requests at once in a fan-out


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

    def submit(self, coro: Coroutine[Any, Any, T], *, scoped: bool = True) -> Future[T]:
        """Schedule ``coro`` on the loop; returns a thread-safe future. Inside a
        :class:`CancelScope` (unless ``scoped=False``: work that must run to its end, such
        as stopping a background task) the scope's :meth:`~CancelScope.cancel` cancels it."""
        scope = _scope.get() if scoped else None
        if scope is not None:
            coro = scope._guard(coro)
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result (never call from the loop itself).

        Inside a cancelled :class:`CancelScope`, raises the scope's error (at once, or once
        the cancelled ``coro`` has ended)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("EventLoopThread.run called from its own loop thread")
        scope = _scope.get()
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException as exc:
            future.cancel()
            # Whatever a cancelled scope's task ended with, the scope's error says why
            # (KeyboardInterrupt and the like stay what they are).
            if isinstance(exc, Exception) and scope is not None and scope.error is not None:
                raise scope.error from None
            raise

    def close(self) -> None:
        """Close the resources registered on the loop, then stop it."""
        if not self.loop.is_running():
            return
        with contextlib.suppress(Exception):
            self.submit(_close_resources(self.resources)).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


_scope: contextvars.ContextVar[CancelScope | None] = contextvars.ContextVar(
    "s3ckpt_cancel_scope", default=None
)


class CancelScope:
    """What the threads inside ``with scope:`` submit to the loop, cancellable at once
    from any thread (a timer, say) with :meth:`cancel`.

    Cancelling cancels the scope's tasks on the loop (their ``finally`` blocks and
    clean-ups run there as for any cancellation); each :meth:`EventLoopThread.run` waiting
    on one raises the scope's error once its task has ended, and every later one raises it
    at once, its coroutine never started. Nothing is raised anywhere else: a thread that
    holds a lock, runs a ``finally`` block or prints when the scope is cancelled carries on
    to its next request, which fails like any failed request.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks: dict[asyncio.Task[Any], asyncio.AbstractEventLoop] = {}
        self.error: BaseException | None = None
        self._token: contextvars.Token[CancelScope | None] | None = None

    def __enter__(self) -> CancelScope:
        self._token = _scope.set(self)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._token is not None:
            _scope.reset(self._token)
            self._token = None

    @property
    def cancelled(self) -> bool:
        return self.error is not None

    def cancel(self, error: BaseException) -> None:
        """Cancel the scope's tasks; its waits raise ``error`` (the first cancel counts)."""
        with self._lock:
            if self.error is not None:
                return
            self.error = error
            tasks = list(self._tasks.items())
        for task, loop in tasks:
            with contextlib.suppress(RuntimeError):  # a loop closed meanwhile: nothing runs
                loop.call_soon_threadsafe(task.cancel)

    async def _guard(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro``, as a task of this scope (runs on the loop)."""
        task = asyncio.current_task()
        assert task is not None
        with self._lock:
            if self.error is None:
                self._tasks[task] = asyncio.get_running_loop()
        if self.error is not None:
            coro.close()
            raise asyncio.CancelledError()
        try:
            return await coro
        finally:
            with self._lock:
                self._tasks.pop(task, None)


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


async def bounded(
    calls: Iterable[Callable[[], Awaitable[T]]], limit: int = DEFAULT_LIMIT
) -> list[T]:
    """Run the calls concurrently, at most ``limit`` at a time; their results in order.

    The first failure is raised once every other call has been cancelled and has stopped;
    no call starts after it.
    """
    slots = asyncio.Semaphore(limit)
    failed = False

    async def run(call: Callable[[], Awaitable[T]]) -> T:
        nonlocal failed
        async with slots:
            if failed:  # a call failed as this one got its slot: wait to be cancelled
                await asyncio.get_running_loop().create_future()
            try:
                return await call()
            except BaseException:
                failed = True
                raise

    tasks = [asyncio.ensure_future(run(c)) for c in calls]
    try:
        # Cancelled from outside, gather cancels every call and returns once they all
        # ended, clean-up included: the cancels below then change nothing.
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def settled(
    calls: Iterable[Callable[[], Awaitable[T]]], limit: int = DEFAULT_LIMIT
) -> list[T | Exception]:
    """Run every call concurrently, at most ``limit`` at a time, whatever the others do;
    each one's result or the exception it raised, in order.

    For clean-ups: one abort or delete that fails must not stop the rest.
    """
    slots = asyncio.Semaphore(limit)

    async def run(call: Callable[[], Awaitable[T]]) -> T | Exception:
        async with slots:
            try:
                return await call()
            except Exception as exc:
                return exc

    return list(await asyncio.gather(*(run(c) for c in calls)))


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
