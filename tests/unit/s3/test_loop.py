"""s3.loop.bounded: results in order, the bound held, the first failure stops the rest."""

from __future__ import annotations

import asyncio

import pytest

from s3ckpt.s3.loop import bounded


def test_results_come_in_call_order_under_the_bound() -> None:
    running, peak = 0, 0

    async def call(i: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.001 * (10 - i))  # later calls finish first
        running -= 1
        return i

    results = asyncio.run(bounded([lambda i=i: call(i) for i in range(10)], limit=3))
    assert results == list(range(10))
    assert peak == 3


def test_first_failure_cancels_the_others_before_it_is_raised() -> None:
    stopped: list[int] = []

    async def slow(i: int) -> int:
        try:
            await asyncio.sleep(3600)  # ended by the cancel or not at all
        except asyncio.CancelledError:
            stopped.append(i)
            raise
        return i

    async def fail() -> int:
        await asyncio.sleep(0.01)
        raise FileNotFoundError("index r3")

    async def main() -> None:
        calls = [lambda i=i: slow(i) for i in range(4)] + [fail]
        with pytest.raises(FileNotFoundError, match="index r3"):
            await asyncio.wait_for(bounded(calls, limit=8), timeout=60)
        # Every other call had been cancelled and had stopped when the failure came out.
        assert sorted(stopped) == [0, 1, 2, 3]

    asyncio.run(main())


def test_calls_not_started_never_start_after_a_failure() -> None:
    started: list[int] = []

    async def call(i: int) -> int:
        started.append(i)
        if i == 0:
            raise ValueError("first")
        await asyncio.sleep(1)
        return i

    with pytest.raises(ValueError, match="first"):
        asyncio.run(bounded([lambda i=i: call(i) for i in range(20)], limit=2))
    assert started == [0]  # the others got their slots after the failure and parked


def test_no_calls_give_no_results() -> None:
    assert asyncio.run(bounded([])) == []


def test_cancelled_from_outside_lets_each_call_finish_its_clean_up() -> None:
    cleaned: list[int] = []

    async def call(i: int) -> int:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)  # an abort request, say: must not be cut short
            cleaned.append(i)
            raise
        return i

    async def main() -> None:
        task = asyncio.ensure_future(bounded([lambda i=i: call(i) for i in range(3)]))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sorted(cleaned) == [0, 1, 2]

    asyncio.run(main())
