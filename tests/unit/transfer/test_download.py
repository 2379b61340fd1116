import asyncio
import contextlib

import pytest
from ranged_bodies import PayloadRange, PayloadStore

from s3ckpt.format.checksums import StreamingCheck, block_crcs
from s3ckpt.transfer.download import _PIECE, ReadTarget, _Admission, _Scatter, plan_requests


def _target(key, start, end, token=None):
    return ReadTarget(key, start, end, memoryview(bytearray(end - start)), token or (key, start))


def test_adjacent_targets_are_coalesced_into_one_request():
    targets = [_target("a", 0, 10), _target("a", 10, 30), _target("a", 30, 31)]
    requests = plan_requests(targets, max_request_size=1000, max_gap=0)
    assert [(r.key, r.start, r.end, len(r.targets)) for r in requests] == [("a", 0, 31, 3)]


def test_gaps_beyond_the_limit_split_requests_and_objects_never_mix():
    targets = [_target("a", 0, 10), _target("a", 100, 110), _target("b", 10, 20)]
    requests = plan_requests(targets, max_request_size=1000, max_gap=50)
    assert sorted((r.key, r.start, r.end) for r in requests) == [
        ("a", 0, 10),
        ("a", 100, 110),
        ("b", 10, 20),
    ]


def test_large_ranges_are_cut_into_parallel_requests():
    targets = [_target("a", 0, 100), _target("a", 100, 250)]
    requests = plan_requests(targets, max_request_size=64, max_gap=0)
    assert [(r.start, r.end) for r in requests] == [(0, 64), (64, 128), (128, 192), (192, 250)]
    assert [len(r.targets) for r in requests] == [1, 2, 1, 1]


def test_scatter_fills_every_target_and_reports_completion_once():
    payload = bytes(range(250))
    targets = [_target("a", 0, 100, "x"), _target("a", 100, 250, "y")]
    buffers = {t.token: t.buffer for t in targets}
    done = []
    for request in plan_requests(targets, max_request_size=64, max_gap=0):
        scatter = _Scatter(request, lambda t: done.append(t.token))
        asyncio.run(scatter.receive(PayloadRange(payload, request.start, request.end)))
    assert done == ["x", "y"]
    assert bytes(buffers["x"]) == payload[:100]
    assert bytes(buffers["y"]) == payload[100:]
    assert all(len(t.buffer) == 0 for t in targets)  # released once complete


def test_buffer_must_match_the_range():
    with pytest.raises(ValueError):
        ReadTarget("a", 0, 10, memoryview(bytearray(5)), None)


PAYLOAD = bytes(range(256)) * 64


def _two_targets(a_range, b_range):
    """Two targets of one object, the ranges given, and the one request that fetches both."""
    buffers = [bytearray(end - start) for start, end in (a_range, b_range)]
    targets = [
        ReadTarget("k", start, end, memoryview(buffer), name)
        for (start, end), buffer, name in zip((a_range, b_range), buffers, "ab", strict=True)
    ]
    (request,) = plan_requests(targets)
    return buffers, targets, request


def test_overlapping_targets_each_receive_their_bytes_through_a_bounce_buffer():
    payload = PAYLOAD
    (buffer_a, buffer_b), _, request = _two_targets((0, 10_000), (8_000, 16_000))
    done = []
    scatter = _Scatter(request, lambda t: done.append(t.token))
    assert scatter.bounce is not None
    asyncio.run(scatter.receive(PayloadRange(payload, 0, 16_000)))
    assert bytes(buffer_a) == payload[:10_000] and bytes(buffer_b) == payload[8_000:16_000]
    assert done == ["a", "b"]


def test_disjoint_targets_are_received_in_place_and_gaps_discarded():
    payload = PAYLOAD
    (buffer_a, buffer_b), (a, b), request = _two_targets((0, 1_000), (3_000, 4_000))
    scatter = _Scatter(request, lambda t: None)
    first = scatter.buffer(0)
    assert first.obj is a.buffer.obj  # the target's own memory: the socket writes into it
    gap = scatter.buffer(1_000)
    assert len(gap) == 2_000 and gap.obj is not a.buffer.obj and gap.obj is not b.buffer.obj
    body = PayloadRange(payload, 0, 4_000)
    asyncio.run(_Scatter(request, lambda t: None).receive(body))  # offsets only go up
    assert body.receives == [1_000, 2_000, 1_000]  # target, gap, target
    assert bytes(buffer_a) == payload[:1_000] and bytes(buffer_b) == payload[3_000:4_000]


def test_a_lazily_allocated_target_takes_its_memory_when_bytes_arrive():
    allocated = []

    def allocate():
        allocated.append(bytearray(100))
        return memoryview(allocated[-1])

    target = ReadTarget("k", 0, 100, None, "t", allocate=allocate)
    (request,) = plan_requests([target])
    scatter = _Scatter(request, lambda t: None)
    assert allocated == []
    asyncio.run(scatter.receive(PayloadRange(bytes(range(100)), 0, 100)))
    assert len(allocated) == 1 and bytes(allocated[0]) == bytes(range(100))


def test_a_lazily_allocated_target_takes_its_memory_once_its_request_is_answered():
    """Memory is taken as the first byte is about to arrive: after the store has opened the
    range (sent the request, read the head), not when the request starts."""
    from s3ckpt.transfer.download import Downloader

    events: list[str] = []

    class Store(PayloadStore):
        def open_range(self, key, start, end):
            events.append("open")
            return super().open_range(key, start, end)

    def allocate():
        events.append("allocate")
        return memoryview(bytearray(100))

    target = ReadTarget("k", 0, 100, None, "t", allocate=allocate)
    assert list(Downloader(Store(lambda key: bytes(100))).fetch([target])) == ["t"]  # type: ignore[arg-type]
    assert events == ["open", "allocate"]


def test_a_large_target_is_received_in_pieces_its_block_checks_fed_as_each_lands():
    payload = bytes(range(256)) * (4 * _PIECE // 256 + 3)
    block = _PIECE // 2
    check = StreamingCheck(block_crcs(memoryview(payload), block), block, 0, len(payload))
    target = ReadTarget("k", 0, len(payload), memoryview(bytearray(len(payload))), "t", check)
    (request,) = plan_requests([target], max_request_size=len(payload))
    body = PayloadRange(payload, 0, len(payload))
    asyncio.run(_Scatter(request, lambda t: None).receive(body))
    assert body.receives == [_PIECE] * 4 + [len(payload) - 4 * _PIECE]
    assert check.active and check.bad_block is None


def test_a_target_needs_a_buffer_or_an_allocator():
    with pytest.raises(ValueError):
        ReadTarget("k", 0, 10, None, "t")


def _lazy(key, start, end):
    return ReadTarget(key, start, end, None, (key, start), allocate=lambda: None)


def test_lazily_allocated_targets_are_not_split_unless_larger_than_a_request():
    targets = [_lazy("a", 0, 40), _lazy("a", 40, 90), _lazy("a", 90, 300), _lazy("a", 300, 310)]
    requests = plan_requests(targets, max_request_size=64, max_gap=0)
    assert [(r.start, r.end) for r in requests] == [
        (0, 40),  # 64 falls inside [40, 90): the cut moves back to its start
        (40, 90),  # 104 falls inside [90, 300), which starts after 40: back to 90
        (90, 154),  # [90, 300) is larger than a request: cut inside it
        (154, 218),
        (218, 282),
        (282, 310),
    ]


class TestAdmission:
    """download._Admission: the byte budget for lazily allocated targets."""

    @staticmethod
    def _run(coro):
        return asyncio.run(coro)

    def test_waits_for_room_and_admits_in_order(self):
        async def scenario():
            budget = _Admission(100)
            await budget.enter(60)
            order = []

            async def enter(name, nbytes):
                await budget.enter(nbytes)
                order.append(name)

            first = asyncio.ensure_future(enter("first", 50))
            second = asyncio.ensure_future(enter("second", 10))  # fits, but waits its turn
            await asyncio.sleep(0)
            assert order == [] and budget.used == 60
            budget.leave(60)
            await asyncio.gather(first, second)
            assert order == ["first", "second"] and budget.used == 60

        self._run(scenario())

    def test_anything_enters_an_empty_budget_and_forced_entries_never_wait(self):
        async def scenario():
            budget = _Admission(100)
            await budget.enter(500)  # larger than the budget, admitted alone
            await budget.enter(30, wait=False)  # a request continuing an admitted target
            assert budget.used == 530

        self._run(scenario())

    def test_a_cancelled_waiter_is_skipped(self):
        async def scenario():
            budget = _Admission(100)
            await budget.enter(100)
            gone = asyncio.ensure_future(budget.enter(80))
            kept = asyncio.ensure_future(budget.enter(20))
            await asyncio.sleep(0)
            gone.cancel()
            await asyncio.sleep(0)
            budget.leave(100)
            await kept
            assert budget.used == 20

        self._run(scenario())


def test_an_abandoned_fetch_stops_its_requests_before_the_caller_moves_on():
    """The caller raises on the first completed target. A request already writing when it
    is cancelled (bytes under way) finishes its write: that must happen before the
    caller's error leaves the loop, never after."""
    from s3ckpt.transfer.download import Downloader

    writes: list[str] = []

    class SlowBody:
        async def receive_into(self, view):
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                await asyncio.sleep(0.2)  # the bytes under way still land
                view[:] = b"\x02" * len(view)
                writes.append("slow")
                raise

    class SlowStore(PayloadStore):
        def open_range(self, key, start, end):
            if key != "slow":
                return super().open_range(key, start, end)
            return contextlib.nullcontext(SlowBody())

    fast, slow = bytearray(10), bytearray(10)
    targets = [
        ReadTarget("fast", 0, 10, memoryview(fast), "fast"),
        ReadTarget("slow", 0, 10, memoryview(slow), "slow"),
    ]
    with pytest.raises(RuntimeError, match="caller failed"):
        for token in Downloader(SlowStore(lambda key: b"\x01" * 10)).fetch(targets):  # type: ignore[arg-type]
            assert token == "fast"
            raise RuntimeError("caller failed")
    # The caller has moved on: the write under way has landed already, not later.
    assert writes == ["slow"] and bytes(slow) == b"\x02" * 10


def test_a_target_with_a_reserve_is_never_coalesced_with_its_neighbours():
    """A piece that takes a whole slab gets requests of its own: one request never takes
    more slabs than the budget it was admitted for."""
    slab = ReadTarget("a", 10, 20, None, "piece", allocate=lambda: None, reserve=1000)
    targets = [_target("a", 0, 10), slab, _target("a", 20, 30), _target("a", 30, 40)]
    requests = plan_requests(targets, max_request_size=1000, max_gap=100)
    assert sorted((r.start, r.end, len(r.targets)) for r in requests) == [
        (0, 10, 1),
        (10, 20, 1),
        (20, 40, 2),
    ]
    assert slab.reserved == 1000 and targets[0].reserved == 10


def test_a_fetch_asks_its_caller_to_give_memory_back_before_it_waits():
    """A download held back by its budget waits on the caller, who waits for the next
    token: a polled fetch yields ``NOTHING_YET`` before any wait, where the caller gives
    the budget back. The budget here admits one lazily allocated target at a time."""
    from s3ckpt.transfer.download import NOTHING_YET, Downloader

    buffers = [memoryview(bytearray(10)) for _ in range(3)]
    targets = [
        ReadTarget("k", 100 * i, 100 * i + 10, None, i, allocate=lambda i=i: buffers[i], reserve=10)
        for i in range(3)
    ]
    reader = Downloader(PayloadStore(lambda key: b"\x07" * 300), lazy_budget=10)  # type: ignore[arg-type]
    held: list[int] = []

    arrived = []
    for token in reader.fetch(targets, True):
        if token is NOTHING_YET:  # no token ready: the caller gives back what it holds
            if held:
                reader.release(10 * len(held))
                held.clear()
            continue
        arrived.append(token)
        held.append(token)  # given back only when no token is ready
    assert sorted(arrived) == [0, 1, 2]
    assert all(bytes(b) == b"\x07" * 10 for b in buffers)
