"""The upload engine: a rank's items become PUTs and multipart uploads, coordinated.

:class:`RankUploader` is the coordinator of one rank's upload, in the manner of
s3transfer's: the calling thread adds items one at a time, each resolved lazily by the
caller (a GPU tensor is copied to the CPU only when its turn comes), and gets back where
the item went (:class:`Placement`). Items are packed into data objects (a new one
whenever ``max_object_size`` would be exceeded: the uploader says so, and the caller,
which owns the layout, names it), each cut by an
:class:`~s3ckpt.transfer.parts.ObjectStream` into requests (a single PUT when it
ends within one part) that flow down as tasks queued on the I/O loop, so parts of every
object upload concurrently under the process-wide request bound, while a byte budget
keeps the producer from running too far ahead of the network. Results come back as
futures: an upload's id to its parts, their results to its completion, the objects to
:meth:`RankUploader.finish`.

Nothing is left behind on failure or cancellation: each task registers its clean-up
where it creates state on the server (a PUT its object's delete, a
CreateMultipartUpload its abort: by id once answered, else by listing the save's unique
key; :mod:`s3ckpt.transfer.aborts`), and :meth:`RankUploader.abandon` cancels every task,
waits for those requests, and runs what they registered. One clean-up request that fails
stops none of the others; what could not be removed is logged, for ``gc``, and the save's
error says so. The clean-up is bounded: after a stalled store
(:class:`~s3ckpt.errors.StoreStalledError`), whose clean-up requests would stall too, by
:data:`~s3ckpt.s3.retry.STILL_STALLED_S`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import posixpath
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from s3ckpt.errors import StorageError, StoreStalledError
from s3ckpt.format.layout import DEFAULT_BLOCK_SIZE
from s3ckpt.s3.loop import bounded, io_loop, settled
from s3ckpt.s3.retry import STILL_STALLED_S
from s3ckpt.s3.store import Body, ObjectStore, PartResult
from s3ckpt.transfer.aborts import (
    CLEAN_UP_REQUESTS,
    CleanUpIncomplete,
    abort_listed_uploads,
    abort_upload,
)
from s3ckpt.transfer.parts import (
    CompleteUpload,
    ObjectStream,
    PutObject,
    Request,
    SendParts,
    StartUpload,
    part_limits,
)
from s3ckpt.transfer.thread_mode import result_of

log = logging.getLogger(__name__)
T = TypeVar("T")
CLEAN_UP_TIMEOUT_S = 120.0
CLEAN_UP_GRACE_S = 10.0  # for the cancelled clean-up's requests to end


def _left_for_gc(error: BaseException | None, bucket: str, keys: list[str]) -> BaseException | None:
    """``error`` (one of the store's) saying that what the save wrote is left for gc."""
    if not isinstance(error, StorageError) or not keys:
        return error
    # The checkpoint's own prefix where the keys are a save's data objects (layout.data_key)
    prefix = keys[0].rpartition("/data/")[0] or posixpath.dirname(keys[0])
    where = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    left = type(error)(
        f"{error}; the clean-up could not remove what this save wrote (its open multipart "
        f"uploads and data objects under {where}): `s3ckpt gc {where}` removes them once "
        "its grace has passed",
        operation=error.operation,
        code=error.code,
        bucket=error.bucket,
        key=error.key,
    )
    left.__cause__ = error.__cause__
    return left


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
    """Coordinates the upload of one rank's objects. Use once, from one thread: :meth:`add`
    each item in order (where it says the item starts a new data object, :meth:`open`
    that and add it again), then :meth:`finish`; on any failure, raise what
    :meth:`abandon` returns.

    ``size_hint`` bounds the bytes the rank will
    write (it sizes parts so that even the largest object stays within 10,000 parts);
    ``in_flight`` bounds the bytes handed over but not yet acknowledged (default: the
    store's ``max_bytes_in_flight``; smaller where every such byte is extra memory, as the
    compressed payloads of a compressed save are).
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        max_object_size: int,
        size_hint: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        in_flight: int | None = None,
    ) -> None:
        self.store = store
        self.block_size = block_size
        self.checksums = store.config.checksums
        self.max_object_size = max_object_size
        self.object_size_hint = max(1, min(max_object_size, size_hint))
        self._loop = io_loop()
        limit = store.config.max_bytes_in_flight
        self._budget = _shared_budget(min(limit, in_flight) if in_flight else limit)
        # Parts go in batches of up to one per request slot and a quarter of the byte
        # budget: few enough hand-overs per GiB (:mod:`s3ckpt.s3.wire.batch`), and two
        # batches at once keep every slot busy while one waits for its slowest part. A
        # batch counts against the budget once handed over: parts packed from small items
        # (copies; parts of one item are views of it) wait in the batch before that, at
        # most a quarter of the budget more.
        self.batch_parts = store.config.max_concurrency
        self.batch_bytes = max(1, self._budget.limit // 4)
        self._streams: list[ObjectStream] = []
        # Per object being written as a multipart upload: its id, and its batches' results.
        self._created: dict[str, Future[str]] = {}
        self._batches: dict[str, list[Future[list[PartResult]]]] = {}
        self._completions: list[Future[UploadedObject]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._unstoppables: list[asyncio.Future[Any]] = []
        self._error: BaseException | None = None
        self._planned_keys: list[str] = []
        # The clean-ups the tasks registered (changed on the I/O loop only): per key, the
        # upload to abort (None: its id never came, so listed), and the keys to delete.
        self._aborts: dict[str, str | None] = {}
        self._deletes: list[str] = []

    def open(self, key: str, first_item: int) -> None:
        """Start the next data object, at ``key``, for an item of ``first_item`` bytes: the
        open one is finished, and the new one's parts sized for the largest it can grow
        to (the usual bound, or its first item where that alone is larger: an item gets
        an object of its own)."""
        streams = self._streams
        if streams:
            self._queue(streams[-1].finish())
        self._planned_keys.append(key)
        largest = max(self.object_size_hint, first_item)
        streams.append(
            ObjectStream(
                key,
                *part_limits(largest, self.store.config.part_size),
                block_size=self.block_size,
                checksums=self.checksums,
                batch_parts=self.batch_parts,
                batch_bytes=self.batch_bytes,
            )
        )

    def add(self, data: memoryview, crcs: tuple[int, ...] | None = None) -> Placement | None:
        """Upload the next item's bytes (with their block CRC32Cs, if known) into the open
        data object; returns where it went, as soon as it has its place. None, and nothing
        added, where the item starts a new object: none is open yet, or the open one, not
        empty, would outgrow ``max_object_size``; the caller then :meth:`open` s it."""
        streams = self._streams
        if not streams or (
            streams[-1].size and streams[-1].size + len(data) > self.max_object_size
        ):
            return None
        offset, requests = streams[-1].add(data, crcs)
        self._queue(requests)
        return Placement(len(streams) - 1, offset, len(data))

    def finish(self) -> list[UploadedObject]:
        """The objects, once every one is stored."""
        if self._streams:
            self._queue(self._streams[-1].finish())
        return [completion.result() for completion in self._completions]

    def abandon(self, error: BaseException) -> BaseException:
        """Give the upload up after ``error``: cancel its tasks and run their clean-ups.
        Returns the error to raise: the first the upload met, saying what was left for
        ``gc`` where the clean-up could not remove it."""
        self._fail(error)
        self._clean_up()
        assert self._error is not None
        return self._error

    # -- producer side (calling thread) -----------------------------------------------

    def _queue(self, requests: list[Request]) -> None:
        """Each request as a task on the I/O loop, in order; what a later one needs of an
        earlier one (an upload's id, its parts' results) it gets as a future."""
        for request in requests:
            match request:
                case PutObject(key, body, checksum):
                    self._completions.append(self._spawn(self._put(key, body, checksum), len(body)))
                case StartUpload(key):
                    self._created[key] = self._spawn(self._create(key), 0)
                    self._batches[key] = []
                case SendParts(key, parts, nbytes):
                    sent = self._spawn(self._parts(key, self._created[key], parts), nbytes)
                    self._batches[key].append(sent)
                case CompleteUpload(key, size):
                    done = self._complete(key, size, self._created[key], self._batches[key])
                    self._completions.append(self._spawn(done, 0))

    def _spawn(self, coro: Coroutine[Any, Any, T], nbytes: int) -> Future[T]:
        """Run ``coro`` on the I/O loop once ``nbytes`` fit in the byte budget."""
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
        """Cancel the tasks and run their clean-ups, within a bound: :data:`CLEAN_UP_TIMEOUT_S`,
        or after a stall :data:`~s3ckpt.s3.retry.STILL_STALLED_S` (the store's idle timeout,
        where shorter), since the clean-up's requests go to the store that just stopped
        answering. What it could not remove is logged and, for the store's errors, named
        in the error."""
        bound = CLEAN_UP_TIMEOUT_S
        if isinstance(self._error, StoreStalledError):
            bound = min(bound, self.store.config.idle_timeout(), STILL_STALLED_S)
        try:
            within = asyncio.wait_for(self._abandon(), bound)  # cancelled when out of time
            self._loop.submit(within).result(timeout=bound + CLEAN_UP_GRACE_S)
        except Exception as exc:  # the original error matters more than a failed clean-up
            timed_out = isinstance(exc, (TimeoutError, asyncio.TimeoutError))
            reason = f"did not finish within {bound:.0f} s" if timed_out else f"failed: {exc}"
            log.warning("clean-up after a failed save %s (gc removes the rest)", reason)
            self._error = _left_for_gc(self._error, self.store.bucket, self._planned_keys)

    # -- I/O side (event loop): the tasks, each registering its clean-up ---------------

    async def _tracked(self, coro: Coroutine[Any, Any, T]) -> T:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await coro
        finally:
            self._tasks.discard(task)

    async def _put(self, key: str, body: Body, checksum: int | None) -> UploadedObject:
        self._deletes.append(key)  # a PUT cut off mid-flight may still land
        etag = await self.store.put(key, body, crc32c=checksum)
        return UploadedObject(key, len(body), etag)

    async def _create(self, key: str) -> str:
        def created(upload_id: str) -> None:  # also when this task is cancelled meanwhile
            self._aborts[key] = upload_id

        self._aborts[key] = None  # until its id comes: found by listing its key
        self._deletes.append(key)  # its completion may land
        return await self._unstoppable(self.store.create_multipart(key), created)

    async def _parts(
        self, key: str, created: Future[str], batch: list[tuple[int, Body, int | None]]
    ) -> list[PartResult]:
        """Upload a batch of ``(part number, body, CRC32C)``: first tried together
        (:meth:`ObjectStore.try_parts <s3ckpt.s3.store.ObjectStore.try_parts>`, native
        threads where the store can), then each part that failed retried on its own."""
        upload_id = await result_of(created)
        tries = await self.store.try_parts(key, upload_id, batch)
        outcomes: list[PartResult | Exception | None] = (
            [None] * len(batch) if tries is None else list(tries)
        )
        again = [n for n, outcome in enumerate(outcomes) if not isinstance(outcome, PartResult)]
        calls = [
            functools.partial(
                self.store.upload_part, key, upload_id, *batch[n], first_try=outcomes[n]
            )
            for n in again
        ]
        for n, result in zip(again, await bounded(calls, limit=max(1, len(calls))), strict=True):
            outcomes[n] = result
        return outcomes  # type: ignore[return-value]  # every one a PartResult now

    async def _complete(
        self,
        key: str,
        size: int,
        created: Future[str],
        batches: list[Future[list[PartResult]]],
    ) -> UploadedObject:
        upload_id = await result_of(created)
        results = [part for b in batches for part in await result_of(b)]
        etag = await self._unstoppable(self.store.complete_multipart(key, upload_id, results))
        self._aborts.pop(key, None)  # no upload left to abort: the object is its delete's
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
        """Cancel everything in flight, then run the registered clean-ups step by step:
        every step runs whatever the one before it did, and every failure is reported at
        the end. The aborts run concurrently under a bound, then one delete of every key
        a request may have written."""
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*self._unstoppables, return_exceptions=True)
        aborts = [
            (lambda k=k, u=u: abort_upload(self.store, k, u))
            if u is not None
            else (lambda k=k: abort_listed_uploads(self.store, k))
            for k, u in self._aborts.items()
        ]
        failures = [r for r in await settled(aborts, CLEAN_UP_REQUESTS) if isinstance(r, Exception)]
        if self._deletes:
            keys = list(dict.fromkeys(self._deletes))
            try:
                await self.store.delete_many(keys)
            except Exception as exc:
                failures.append(CleanUpIncomplete(f"objects {', '.join(keys)} not deleted: {exc}"))
        if failures:
            raise CleanUpIncomplete("; ".join(str(f) for f in failures))
