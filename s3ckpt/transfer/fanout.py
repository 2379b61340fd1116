"""Many requests at once under a bound, failing fast: the fan-out every batch of requests uses.

A listing of folders, the manifests of many checkpoints, a load's rank indexes, batches of
deletes: each is a set of independent requests whose results are all needed. They run
concurrently, at most ``limit`` at a time, and the first failure cancels the rest and
waits for them, so nothing keeps reading or deleting after an error has been reported.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_LIMIT = 8


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
