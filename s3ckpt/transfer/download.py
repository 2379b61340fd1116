"""The download engine: parallel ranged GETs, coalesced, streamed straight into buffers.

Callers describe what they need as :class:`ReadTarget` s: bytes ``[start, end)`` of an
object and the buffer they must land in (often the destination tensor itself). Targets
of the same object that are adjacent, or separated by a small gap, are coalesced into
one range; ranges are then cut into requests of at most ``max_request_size`` so that one
large tensor is also fetched in parallel. Each response is received straight into the
buffers it covers: each request's loop asks the store for the next bytes into the memory
they land in (:mod:`s3ckpt.s3.wire`: the socket writes into the tensor), so no range is
ever held twice.

A target may carry a :class:`~s3ckpt.format.checksums.StreamingCheck`: ranges are then cut at
the target's checksum-block boundaries, so that every block arrives within one response,
in order, and its CRC32C is computed on the loop right after each receive, while the
bytes are still in cache. As soon as a target's last byte arrives its token is handed to the
calling thread, which finishes it (copies into non-contiguous or GPU destinations,
``planner.load_bytes``) while the loop keeps downloading.

Targets whose memory is allocated lazily (compressed frames, received into buffers of
their own and then decoded) can be held to a byte budget: a request that starts such
targets waits until the caller has released enough of the earlier ones
(:meth:`Downloader.release`). Fresh memory is expensive to touch for the first time,
and without the bound the download would run ahead of the decoders, filling new buffers.
"""

from __future__ import annotations

import asyncio
import bisect
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from s3ckpt.format.checksums import StreamingCheck
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.ranged_read import RangedRead
from s3ckpt.s3.store import ObjectStore

MiB = 1024 * 1024
DEFAULT_REQUEST_SIZE = 16 * MiB
DEFAULT_MAX_GAP = 256 * 1024


@dataclass(eq=False)
class ReadTarget:
    """Bytes ``[start, end)`` of ``key``, to land in ``buffer``.

    ``buffer`` may be ``None`` with ``allocate`` given instead: the memory is then taken
    when the first byte arrives, so a load holds buffers only for what is in flight.
    ``reserve`` is what such a target counts against the reader's budget while it holds
    its memory (its length unless given: a piece received into a fixed-size slab holds
    the whole slab).
    """

    key: str
    start: int
    end: int
    buffer: memoryview | None
    token: object
    check: StreamingCheck | None = None
    allocate: Callable[[], memoryview] | None = None
    reserve: int | None = None
    remaining: int = field(init=False)
    # Requests that split a target land its bytes interleaved; the lock keeps its lazy
    # allocation and its count of bytes still to come whole, whatever thread calls.
    lock: threading.RLock = field(init=False, repr=False, default_factory=threading.RLock)

    def __post_init__(self) -> None:
        if self.buffer is None and self.allocate is None:
            raise ValueError("a read target needs a buffer or a way to allocate one")
        if self.buffer is not None:
            self._check_length(self.buffer)
        self.remaining = self.end - self.start

    @property
    def reserved(self) -> int:
        """Bytes this target counts against the budget while it holds its memory."""
        return self.end - self.start if self.reserve is None else self.reserve

    def memory(self) -> memoryview:
        """The buffer, allocated now if it was given lazily."""
        if self.buffer is None:
            with self.lock:
                if self.buffer is None:
                    assert self.allocate is not None
                    self.buffer = self._check_length(self.allocate())
        return self.buffer

    def _check_length(self, buffer: memoryview) -> memoryview:
        if len(buffer) != self.end - self.start:
            raise ValueError("buffer length must equal end - start")
        return buffer


@dataclass
class RangeRequest:
    key: str
    start: int
    end: int
    targets: list[ReadTarget]


def plan_requests(
    targets: list[ReadTarget],
    *,
    max_request_size: int = DEFAULT_REQUEST_SIZE,
    max_gap: int = DEFAULT_MAX_GAP,
) -> list[RangeRequest]:
    """Coalesce targets per object into ranges, then cut ranges into requests (pure)."""
    by_key: dict[str, list[ReadTarget]] = {}
    for target in targets:
        if target.end > target.start:
            by_key.setdefault(target.key, []).append(target)
    requests: list[RangeRequest] = []
    for key, group in by_key.items():
        group.sort(key=lambda t: t.start)
        for start, end, members in _coalesce(group, max_gap):
            starts = [t.start for t in members]
            for piece_start, piece_end in _cuts(start, end, members, starts, max_request_size):
                hi = bisect.bisect_left(starts, piece_end)
                overlapping = [t for t in members[:hi] if t.end > piece_start]
                if overlapping:
                    requests.append(RangeRequest(key, piece_start, piece_end, overlapping))
    _disable_split_checks(requests)
    return requests


def _cuts(
    start: int, end: int, members: list[ReadTarget], starts: list[int], size: int
) -> Iterator[tuple[int, int]]:
    """Request boundaries about ``size`` apart, moved onto checksum-block boundaries."""
    position = start
    while position < end:
        cut = min(position + size, end)
        if cut < end:
            cut = _block_boundary(cut, position, members, starts)
        yield position, cut
        position = cut


def _block_boundary(cut: int, floor: int, members: list[ReadTarget], starts: list[int]) -> int:
    """``cut`` moved back (or, if that reaches ``floor``, forward) to a block boundary.

    A lazily allocated target is not split at all unless it is larger than a request: the
    cut moves back to its start, so that a request starting it never also carries the
    rest of one started earlier (which the download's budget could not hold back).
    """
    index = bisect.bisect_right(starts, cut) - 1
    if index < 0 or members[index].end <= cut:
        return cut
    target = members[index]
    if target.allocate is not None and target.start > floor:
        return target.start
    if target.check is None:
        return cut
    block = target.check.block_size
    back = target.start + (cut - target.start) // block * block
    if back > floor:
        return back
    return min(target.start + -(-(cut - target.start) // block) * block, target.end)


def _disable_split_checks(requests: list[RangeRequest]) -> None:
    """Streaming checks need whole blocks per response; otherwise the caller verifies."""
    for request in requests:
        for target in request.targets:
            check = target.check
            if check is None or not check.active:
                continue
            for edge in (max(request.start, target.start), min(request.end, target.end)):
                if (
                    edge not in (target.start, target.end)
                    and (edge - target.start) % check.block_size
                ):
                    check.disable()
                    break


def _coalesce(group: list[ReadTarget], max_gap: int) -> Iterator[tuple[int, int, list[ReadTarget]]]:
    """Runs of targets at most ``max_gap`` apart; a target with a ``reserve`` (a piece that
    takes a whole slab) stays in a run of its own, so one request takes one slab at most."""
    start, end, members = group[0].start, group[0].end, [group[0]]
    for target in group[1:]:
        alone = target.reserve is not None or members[-1].reserve is not None
        if target.start - end <= max_gap and not alone:
            end = max(end, target.end)
            members.append(target)
        else:
            yield start, end, members
            start, end, members = target.start, target.end, [target]
    yield start, end, members


class _Scatter:
    """One request's receive loop: it asks the store for the range's bytes a piece of
    memory at a time (:meth:`receive`) and lands them in their targets.

    Bytes arrive in offset order and targets are sorted by start, so a cursor skips the
    targets already filled. Each piece is a target's own memory, so the response is
    received straight into it, at most :data:`_PIECE` bytes, whose block CRCs are fed
    right after, while the bytes are in cache; bytes in a gap between coalesced targets go to a
    discard buffer. Where targets overlap (ranges padded to checksum blocks can share a
    block), bytes are received into a bounce buffer and copied into every target.
    """

    def __init__(self, request: RangeRequest, done: Callable[[ReadTarget], None]) -> None:
        self.targets = request.targets
        self.start = request.start
        self.end = request.end
        self.done = done
        self.first = 0
        self.bounce = memoryview(bytearray(_BOUNCE)) if _overlapping(request.targets) else None

    async def receive(self, read: RangedRead) -> None:
        """Pull the whole range from ``read``, each piece into the memory it lands in."""
        position = self.start
        while position < self.end:
            count = await read.receive_into(self.buffer(position))
            self.filled(position, count)
            position += count

    def buffer(self, offset: int) -> memoryview:
        """The memory the bytes from ``offset`` are received into (a lazily allocated
        target takes its memory now, as its bytes are about to arrive)."""
        if self.bounce is not None:
            return self.bounce[: min(len(self.bounce), self.end - offset)]
        target = self._at(offset)
        if target is not None and target.start <= offset:
            within = offset - target.start
            return target.memory()[within : within + min(_PIECE, self.end - offset)]
        gap_end = target.start if target is not None else self.end
        return _DISCARD[: min(len(_DISCARD), gap_end - offset)]

    def filled(self, offset: int, nbytes: int) -> None:
        """``nbytes`` bytes from ``offset`` are in the memory :meth:`buffer` gave."""
        if self.bounce is not None:
            self._copy(offset, self.bounce[:nbytes])
            return
        target = self._at(offset)
        if target is not None and target.start <= offset:
            self._landed(target, offset - target.start, nbytes)

    def _at(self, offset: int) -> ReadTarget | None:
        """The first target not yet passed at ``offset`` (None past the last)."""
        targets = self.targets
        while self.first < len(targets) and targets[self.first].end <= offset:
            self.first += 1
        return targets[self.first] if self.first < len(targets) else None

    def _landed(self, target: ReadTarget, within: int, nbytes: int) -> None:
        with target.lock:  # other requests of the same target may land bytes at once
            if target.check is not None:
                target.check.feed(within, target.memory()[within : within + nbytes])
            target.remaining -= nbytes
            finished = target.remaining == 0
            if finished:
                target.buffer = _RELEASED  # the caller holds its own reference until done
        if finished:
            self.done(target)

    def _copy(self, offset: int, chunk: memoryview) -> None:
        """Copy ``chunk`` into every target it overlaps (the bounce path)."""
        end = offset + len(chunk)
        for target in self.targets:
            if target.start >= end:
                break
            lo, hi = max(offset, target.start), min(end, target.end)
            if lo < hi:
                target.memory()[lo - target.start : hi - target.start] = chunk[
                    lo - offset : hi - offset
                ]
                self._landed(target, lo - target.start, hi - lo)


_BOUNCE = 1024 * 1024
# Largest piece of a target received at once: each receive costs a wake-up of its
# request's task, so it should move a lot, and its block CRCs are fed right after, while
# the bytes are still in cache (the size of least client CPU per GiB, measured).
_PIECE = 4 * 1024 * 1024
_DISCARD = memoryview(bytearray(DEFAULT_MAX_GAP))
_RELEASED = memoryview(b"")  # gap bytes between coalesced targets


def _overlapping(targets: list[ReadTarget]) -> bool:
    """Whether any two targets (sorted by start) share bytes."""
    reach = -1
    for target in targets:
        if target.start < reach:
            return True
        reach = max(reach, target.end)
    return False


class _Admission:
    """A byte budget on the loop, first come first served.

    :meth:`enter` waits while admitting ``nbytes`` would exceed the limit (anything is
    admitted into an empty budget, so one large target cannot wait forever).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def enter(self, nbytes: int, *, wait: bool = True) -> None:
        if not wait or (not self._waiting and self._fits(nbytes)):
            self.used += nbytes
            return
        admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((nbytes, admitted))
        await admitted

    def leave(self, nbytes: int) -> None:
        self.used -= nbytes
        while self._waiting:
            nbytes, admitted = self._waiting[0]
            if not admitted.cancelled():
                if not self._fits(nbytes):
                    return
                self.used += nbytes
                admitted.set_result(None)
            self._waiting.popleft()

    def _fits(self, nbytes: int) -> bool:
        return self.used == 0 or self.used + nbytes <= self.limit


_FINISHED = object()
NOTHING_YET = object()  # yielded by Downloader.fetch(poll=True) while no token is ready
# Further reads of a range whose bytes failed their checksum, each on fresh connections:
# a mismatch in a GET body is most often damage in transit, not in the object.
REREADS = 3


class Downloader:
    """Fetches targets with parallel ranged GETs; yields their tokens as each completes.

    ``lazy_budget``: bytes of lazily allocated targets (``allocate`` given, no buffer)
    admitted at once; the caller gives each one back with :meth:`release` once it is done
    with its memory. ``None``: no bound.
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        max_request_size: int = DEFAULT_REQUEST_SIZE,
        lazy_budget: int | None = None,
    ) -> None:
        self.store = store
        self.max_request_size = max_request_size
        self._admission = _Admission(lazy_budget) if lazy_budget else None
        self._releases = 0  # changes with every release, whatever thread gives back

    def release(self, nbytes: int) -> None:
        """Give back a lazily allocated target of ``nbytes`` (from any thread)."""
        self._releases += 1
        if self._admission is not None:
            io_loop().loop.call_soon_threadsafe(self._admission.leave, nbytes)

    def fetch(self, targets: list[ReadTarget], poll: bool = False) -> Iterator[object]:
        """Yield each target's token once all its bytes have arrived (in arrival order).

        Empty targets are yielded first. Raises the first I/O error; abandoning the
        iterator cancels the requests still running and waits until they have stopped, so
        no byte lands in a target after the caller has moved on (to raise an error, say).
        ``poll``: :data:`NOTHING_YET` is yielded whenever no token is ready, before waiting
        for one; the caller may give memory back then (:meth:`release`), and is offered
        the chance again for as long as it does. So a download held back by the budget is
        never left waiting on a caller that waits on it.
        """
        completed: queue.SimpleQueue[object] = queue.SimpleQueue()
        for target in targets:
            if target.end == target.start:
                yield target.token
        requests = plan_requests(targets, max_request_size=self.max_request_size)
        loop = io_loop()
        task = loop.run(self._start(requests, lambda t: completed.put(t.token)))
        future = loop.submit(_outcome(task))
        future.add_done_callback(lambda _: completed.put(_FINISHED))
        try:
            while True:
                try:
                    token = completed.get_nowait() if poll else completed.get()
                except queue.Empty:
                    releases = self._releases
                    yield NOTHING_YET
                    if self._releases != releases:
                        continue  # memory came back: look again before waiting
                    token = completed.get()
                if token is _FINISHED:
                    break
                yield token
            future.result()
        finally:
            if not future.done():
                loop.run(_stopped(task))

    def fetch_again(self, targets: list[ReadTarget]) -> None:
        """Fetch ``targets`` anew, on fresh connections, after their bytes failed a check
        (see :data:`REREADS`); returns once every byte has arrived."""
        io_loop().run(self.store.close_idle_connections())
        for _ in self.fetch(targets):
            pass

    async def _start(
        self, requests: list[RangeRequest], done: Callable[[ReadTarget], None]
    ) -> asyncio.Task[None]:
        return asyncio.ensure_future(self._run(requests, done))

    async def _run(self, requests: list[RangeRequest], done: Callable[[ReadTarget], None]) -> None:
        tasks = [asyncio.ensure_future(self._request(r, done)) for r in requests]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _request(self, request: RangeRequest, done: Callable[[ReadTarget], None]) -> None:
        if self._admission is not None:
            lazy = [t for t in request.targets if t.allocate is not None]
            starting = sum(t.reserved for t in lazy if t.start >= request.start)
            # A request that carries the rest of a target admitted earlier never waits:
            # that target's release depends on it.
            continuing = any(t.start < request.start for t in lazy)
            if starting:
                await self._admission.enter(starting, wait=not continuing)
        async with self.store.open_range(request.key, request.start, request.end) as read:
            await _Scatter(request, done).receive(read)


async def _outcome(task: asyncio.Task[None]) -> None:
    await task


async def _stopped(task: asyncio.Task[None]) -> None:
    """Cancel a fetch and return once it has stopped (its requests cancelled and awaited)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
