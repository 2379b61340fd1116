"""The upload engine: a rank's planned objects become PUTs and multipart uploads.

The calling thread feeds a stream of items, each resolved lazily (a GPU tensor is copied
to the CPU only when its turn comes, a compressed item when its compression finishes),
and the uploader packs them into data objects (a new one whenever ``max_object_size``
would be exceeded) and cuts each object into parts on the fly (:class:`~s3ckpt.transfer.parts.
PartCutter`). A part inside one item is sent as a ``memoryview`` of that item's memory;
only parts straddling item boundaries are joined into a fresh buffer. An object that
ends within one part is sent as a single PUT. Each part carries its CRC32C; parts of an
item are cut on its checksum blocks, so that CRC is combined from the item's block CRC32Cs
(computed once, for the manifest) instead of read from memory a second time. Each part
becomes a small task on the I/O loop, so parts of every object upload concurrently under the
process-wide request bound, while a byte budget keeps the producer from running too far
ahead of the network.

Nothing is left behind on failure or cancellation: every task is cancelled and awaited,
every multipart upload this save created is aborted (by its id; only those whose
CreateMultipartUpload response never arrived are found by listing the save's unique keys),
and objects already completed are deleted. One clean-up request that fails stops none of
the others; what could not be removed is logged, for ``gc``.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import sys
import threading
from collections.abc import Callable, Coroutine, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from crc32c import crc32c

from s3ckpt.format.checksums import combine, range_crc
from s3ckpt.format.layout import DEFAULT_BLOCK_SIZE, is_rank_data
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import Body, ObjectStore, PartResult
from s3ckpt.transfer.fanout import settled
from s3ckpt.transfer.parts import PartCutter, part_limits

log = logging.getLogger(__name__)
T = TypeVar("T")
# (index, stored bytes, their block CRC32Cs when known): what the uploader is fed.
Item = tuple[object, memoryview, tuple[int, ...] | None]
CLEAN_UP_REQUESTS = 16  # aborts of one failed rank's uploads in flight at once
CLEAN_UP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class UploadedObject:
    key: str
    size: int
    etag: str


@dataclass(frozen=True)
class Placement:
    """Where an item went: the number of its data object, and its byte range there."""

    object: int
    offset: int
    length: int


class _ByteBudget:
    """Blocks the producer while more than ``limit`` bytes are queued or in flight."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int, abandoned: Callable[[], bool]) -> None:
        with self._cond:
            while self.used and self.used + nbytes > self.limit and not abandoned():
                self._cond.wait(timeout=0.5)
            self.used += nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.used -= nbytes
            self._cond.notify_all()


def _shared_budget(limit: int) -> _ByteBudget:
    """The process-wide budget for ``limit``: saves running at once share one bound."""
    resources = io_loop().resources
    key = ("byte-budget", limit)
    if key not in resources:
        resources.setdefault(key, _ByteBudget(limit))
    return resources[key]


class RankUploader:
    """Uploads the objects of one rank's save. Use once, from one thread.

    ``object_key(n)`` names data object ``n``; ``size_hint`` bounds the bytes the rank will
    write (it sizes parts so that even the largest object stays within 10,000 parts);
    ``in_flight`` bounds the bytes handed over but not yet acknowledged (default: the
    store's ``max_bytes_in_flight``; smaller where every such byte is extra memory, as the
    compressed payloads of a compressed save are).
    """

    def __init__(
        self,
        store: ObjectStore,
        object_key: Callable[[int], str],
        *,
        max_object_size: int,
        size_hint: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        in_flight: int | None = None,
    ) -> None:
        self.store = store
        self.block_size = block_size
        self.object_key = object_key
        self.max_object_size = max_object_size
        self.object_size_hint = max(1, min(max_object_size, size_hint))
        self._loop = io_loop()
        limit = store.config.max_bytes_in_flight
        self._budget = _shared_budget(min(limit, in_flight) if in_flight else limit)
        self._futures: list[Future[Any]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._upload_ids: dict[str, str] = {}
        self._unstoppables: list[asyncio.Future[Any]] = []
        self._error: BaseException | None = None
        self._planned_keys: list[str] = []
        self._created: list[str] = []  # keys whose CreateMultipartUpload was sent

    def upload(self, items: Iterable[Item]) -> tuple[dict[object, Placement], list[UploadedObject]]:
        """Upload ``(index, bytes, block CRC32Cs or None)`` items in order; returns where
        each went, and the objects."""
        placements: dict[object, Placement] = {}
        streams: list[_ObjectStream] = []
        try:
            for index, data, crcs in items:
                if not streams or (
                    streams[-1].size and streams[-1].size + len(data) > self.max_object_size
                ):
                    if streams:
                        streams[-1].finish()
                    streams.append(self._open(len(streams), len(data)))
                offset = streams[-1].add(data, crcs)
                placements[index] = Placement(len(streams) - 1, offset, len(data))
            if streams:
                streams[-1].finish()
            results = [stream.completion.result() for stream in streams]  # type: ignore[union-attr]
        except BaseException as exc:
            self._fail(exc)
            self._clean_up()
            raise self._error from None  # type: ignore[misc]
        return placements, results

    def _open(self, number: int, first_item: int) -> _ObjectStream:
        """A new object, its parts sized for the largest it can grow to: the usual bound,
        or its first item where that alone is larger (an item gets an object of its own)."""
        key = self.object_key(number)
        self._planned_keys.append(key)
        largest = max(self.object_size_hint, first_item)
        return _ObjectStream(self, key, *part_limits(largest, self.store.config.part_size))

    # -- producer side (calling thread) -----------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, Any], nbytes: int) -> Future[Any]:
        try:
            self._raise_if_failed()
            self._budget.acquire(nbytes, lambda: self._error is not None)
        except BaseException:
            coro.close()
            raise
        if self._error is not None:
            self._budget.release(nbytes)
            coro.close()
            raise self._error
        future = self._loop.submit(self._tracked(coro))
        future.add_done_callback(lambda f: self._settle(f, nbytes))
        self._futures.append(future)
        return future

    def _settle(self, future: Future[Any], nbytes: int) -> None:
        self._budget.release(nbytes)
        if not future.cancelled() and future.exception() is not None and self._error is None:
            self._error = future.exception()

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _clean_up(self) -> None:
        try:
            self._loop.submit(self._abandon()).result(timeout=CLEAN_UP_TIMEOUT_S)
        except Exception as exc:  # the original error matters more than a failed clean-up
            log.warning(
                "clean-up after a failed save was incomplete (gc removes the rest): %s", exc
            )

    # -- I/O side (event loop) --------------------------------------------------------

    async def _tracked(self, coro: Coroutine[Any, Any, Any]) -> Any:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await coro
        finally:
            self._tasks.discard(task)

    async def _put(self, key: str, body: Body, checksum: int | None) -> UploadedObject:
        etag = await self.store.put(key, body, crc32c=checksum)
        return UploadedObject(key, len(body), etag)

    async def _create(self, key: str) -> str:
        def record(upload_id: str) -> None:  # also when this task is cancelled meanwhile
            self._upload_ids[key] = upload_id

        self._created.append(key)

        return await self._unstoppable(self.store.create_multipart(key), record)

    async def _part(
        self, key: str, created: Future[str], number: int, body: Body, checksum: int | None
    ) -> PartResult:
        upload_id = await asyncio.wrap_future(created)
        return await self.store.upload_part(key, upload_id, number, body, checksum)

    async def _complete(
        self, key: str, size: int, created: Future[str], parts: list[Future[PartResult]]
    ) -> UploadedObject:
        upload_id = await asyncio.wrap_future(created)
        results = [await asyncio.wrap_future(p) for p in parts]
        etag = await self._unstoppable(self.store.complete_multipart(key, upload_id, results))
        self._upload_ids.pop(key, None)
        return UploadedObject(key, size, etag)

    async def _unstoppable(
        self, request: Coroutine[Any, Any, T], on_result: Callable[[T], None] | None = None
    ) -> T:
        """Run a request that creates state on the server (an upload, an object) so that
        cancelling the caller does not cut it off: a request cut off mid-flight may still
        take effect on the server after the clean-up looked, leaving an orphan behind.
        :meth:`_abandon` waits for these to finish before it cleans up."""
        future = asyncio.ensure_future(request)
        self._unstoppables.append(future)

        def settled(done: asyncio.Future[T]) -> None:
            if not done.cancelled() and done.exception() is None and on_result is not None:
                on_result(done.result())

        future.add_done_callback(settled)
        return await asyncio.shield(future)

    async def _abandon(self) -> None:
        """Cancel everything in flight, then clean up step by step: every step runs
        whatever the one before it did, and every failure is reported at the end.

        Uploads whose id is known are aborted without listing; only keys whose
        CreateMultipartUpload was sent but never answered are looked up, by listing. The
        aborts run concurrently under a bound; the deletes of every planned key always run.
        """
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*self._unstoppables, return_exceptions=True)
        known = dict(self._upload_ids)
        unanswered = [key for key in self._created if key not in known]
        aborts = [lambda k=k, u=u: self._abort(k, u) for k, u in known.items()]
        aborts += [lambda k=k: self._abort_listed(k) for k in unanswered]
        failures = [r for r in await settled(aborts, CLEAN_UP_REQUESTS) if isinstance(r, Exception)]
        if self._planned_keys:
            try:
                await self.store.delete_many(self._planned_keys)
            except Exception as exc:
                failures.append(
                    CleanUpIncomplete(f"objects {', '.join(self._planned_keys)} not deleted: {exc}")
                )
        if failures:
            raise CleanUpIncomplete("; ".join(str(f) for f in failures))

    async def _abort(self, key: str, upload_id: str) -> None:
        try:
            await self.store.abort_multipart(key, upload_id)
        except Exception as exc:
            raise CleanUpIncomplete(f"upload {upload_id} of {key} not aborted: {exc}") from exc

    async def _abort_listed(self, key: str) -> None:
        """Abort the uploads of ``key`` a lost CreateMultipartUpload response left unknown."""
        try:
            found = [
                p.upload_id async for p in self.store.list_multipart_uploads(key) if p.key == key
            ]
        except Exception as exc:
            raise CleanUpIncomplete(f"uploads of {key} not listed: {exc}") from exc
        for upload_id in found:
            await self._abort(key, upload_id)


async def abort_rank_uploads(store: ObjectStore, prefix: str, rank: int) -> int:
    """Abort every open multipart upload of rank ``rank``'s data objects under ``prefix``
    (a checkpoint's keys, ``.../step-N/``): what a save leaves when the process that ran
    it died with nobody left in it to abort them. Returns how many were aborted."""
    found = [
        upload
        async for upload in store.list_multipart_uploads(prefix)
        if is_rank_data(upload.key[len(prefix) :], rank)
    ]
    aborts = [lambda u=u: store.abort_multipart(u.key, u.upload_id) for u in found]
    failures = [r for r in await settled(aborts, CLEAN_UP_REQUESTS) if isinstance(r, Exception)]
    if failures:
        raise CleanUpIncomplete("; ".join(str(f) for f in failures))
    return len(found)


class CleanUpIncomplete(Exception):
    """What a clean-up after a failed save could not remove (``gc`` removes it later)."""


class _ObjectStream:
    """One data object being written, fed item by item from the producer thread.

    Parts are held back while the object is no larger than one part: if it ends there it
    is sent as a single PUT; the moment it outgrows a part, the multipart upload starts.
    """

    def __init__(self, uploader: RankUploader, key: str, part_size: int, min_part: int) -> None:
        self.uploader = uploader
        self.key = key
        self.part_size = part_size
        self.cutter = PartCutter(part_size, min_part, uploader.block_size)
        self.checksums = uploader.store.config.checksums
        self.size = 0
        self.data: dict[int, memoryview] = {}  # items with pieces still to send
        self.crcs: dict[int, tuple[int, ...]] = {}  # their block CRC32Cs, where known
        self.count = 0
        self.held: list[tuple[Body, int | None]] = []
        self.created: Future[str] | None = None
        self.parts: list[Future[PartResult]] = []
        self.completion: Future[UploadedObject] | None = None

    def add(self, data: memoryview, crcs: tuple[int, ...] | None = None) -> int:
        """Append an item (with its block CRC32Cs, if known); returns its offset in the object."""
        number, offset = self.count, self.size
        self.count += 1
        self.size += len(data)
        if len(data):
            self.data[number] = data
            if crcs is not None:
                self.crcs[number] = crcs
        for part in self.cutter.add(number, len(data)):
            self._emit(part)
        return offset

    def finish(self) -> None:
        for part in self.cutter.finish():
            self._emit(part)
        up = self.uploader
        if self.created is None:
            body = _join([memoryview(b) for b, _ in self.held]) if self.held else b""
            checksum = _combined([(c, len(b)) for b, c in self.held]) if self.checksums else None
            self.completion = up._spawn(up._put(self.key, body, checksum), len(body))
        else:
            self.completion = up._spawn(
                up._complete(self.key, self.size, self.created, self.parts), 0
            )

    def _emit(self, part: list[tuple[int, int, int]]) -> None:
        part = [(item, start, end) for item, start, end in part if end > start]
        pieces = [self.data[item][start:end] for item, start, end in part]
        checksum = (
            _combined([(self._crc(*p), p[2] - p[1]) for p in part]) if self.checksums else None
        )
        for item, _, end in part:
            if end == len(self.data[item]):
                del self.data[item]
                self.crcs.pop(item, None)
        body = _join(pieces) if pieces else b""
        if self.created is None and sum(len(b) for b, _ in self.held) + len(body) <= self.part_size:
            self.held.append((body, checksum))
            return
        up = self.uploader
        if self.created is None:
            self.created = up._spawn(up._create(self.key), 0)
            for held, held_checksum in self.held:
                self._send(held, held_checksum)
            self.held = []
        self._send(body, checksum)

    def _crc(self, item: int, start: int, end: int) -> int:
        """CRC32C of a piece of an item: combined from its block CRCs where the piece is
        whole blocks, else computed."""
        data, blocks = self.data[item], self.crcs.get(item)
        if blocks is not None:
            crc = range_crc(blocks, self.uploader.block_size, len(data), start, end)
            if crc is not None:
                return crc
        return crc32c(data[start:end])

    def _send(self, body: Body, checksum: int | None) -> None:
        up = self.uploader
        assert self.created is not None
        number = len(self.parts) + 1
        self.parts.append(
            up._spawn(up._part(self.key, self.created, number, body, checksum), len(body))
        )


def _combined(pieces: list[tuple[int | None, int]]) -> int:
    """The CRC32C of consecutive pieces from theirs: ``(crc, length)`` each."""
    total = 0  # the CRC32C of no bytes
    for crc, length in pieces:
        assert crc is not None
        total = combine(total, crc, length)
    return total


def _join(pieces: list[memoryview]) -> Body:
    """One body from pieces: the piece itself when there is one (no copy), else a joined
    copy made without holding the GIL (:func:`_copy_joined`)."""
    if len(pieces) == 1:
        return pieces[0]
    if any(piece.readonly for piece in pieces):
        return b"".join(pieces)
    return _copy_joined(pieces)


# ``bytes.join`` copies with the GIL held: 2.0 ms per 16 MiB part packed from small items,
# during which a training loop's thread (thread mode) cannot run. Here the bytes object is
# allocated uninitialized (``PyBytes_FromStringAndSize(NULL, n)``, as ``join`` itself
# does) and filled by ``memmove`` through ctypes, which releases the GIL: the same CPU
# (2.1 ms), while a Python thread beside it ran 2.1x as many operations as beside ``join``.
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_BYTES_DATA = sys.getsizeof(b"") - 1  # the offset of a bytes object's data (ob_sval)


def _copy_joined(pieces: list[memoryview]) -> bytes:
    joined = _new_bytes(None, sum(len(piece) for piece in pieces))
    at = id(joined) + _BYTES_DATA
    for piece in pieces:
        if len(piece):
            ctypes.memmove(at, ctypes.addressof(ctypes.c_char.from_buffer(piece)), len(piece))
            at += len(piece)
    return joined
