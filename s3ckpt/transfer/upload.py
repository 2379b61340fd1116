"""The upload engine: a rank's planned objects become PUTs and multipart uploads.

The calling thread feeds a stream of items, each resolved lazily (a GPU tensor is copied
to the CPU only when its turn comes, a compressed item when its compression finishes),
and the uploader packs them into data objects (a new one whenever ``max_object_size``
would be exceeded), each fed to an :class:`~s3ckpt.transfer.object_stream.ObjectStream`
that cuts it into parts on the fly (a single PUT when it ends within one part). Each part
becomes a small task on the I/O loop, so parts of every object upload concurrently under the
process-wide request bound, while a byte budget keeps the producer from running too far
ahead of the network.

Nothing is left behind on failure or cancellation: every task is cancelled and awaited,
every multipart upload this save created is aborted (by its id; only those whose
CreateMultipartUpload response never arrived are found by listing the save's unique keys),
and objects already completed are deleted (:mod:`s3ckpt.transfer.aborts`). One clean-up
request that fails stops none of the others; what could not be removed is logged, for
``gc``, and the save's error says so. The clean-up is bounded: after a stalled store
(:class:`~s3ckpt.errors.StoreStalledError`), whose clean-up requests would stall too, by
:data:`~s3ckpt.s3.retry.STILL_STALLED_S`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import posixpath
import threading
from collections.abc import Callable, Coroutine, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from s3ckpt.errors import StorageError, StoreStalledError
from s3ckpt.format.layout import DEFAULT_BLOCK_SIZE
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.retry import STILL_STALLED_S
from s3ckpt.s3.store import Body, ObjectStore, PartResult
from s3ckpt.transfer.aborts import (
    CLEAN_UP_REQUESTS,
    CleanUpIncomplete,
    abort_listed_uploads,
    abort_upload,
)
from s3ckpt.transfer.fanout import bounded, settled
from s3ckpt.transfer.object_stream import ObjectStream
from s3ckpt.transfer.parts import part_limits
from s3ckpt.transfer.thread_mode import result_of

log = logging.getLogger(__name__)
T = TypeVar("T")
# (index, stored bytes, their block CRC32Cs when known): what the uploader is fed.
Item = tuple[object, memoryview, tuple[int, ...] | None]
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
        self.checksums = store.config.checksums
        self.object_key = object_key
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
        self._futures: list[Future[Any]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._upload_ids: dict[str, str] = {}
        self._unstoppables: list[asyncio.Future[Any]] = []
        self._error: BaseException | None = None
        self._planned_keys: list[str] = []
        self._created: list[str] = []  # keys whose CreateMultipartUpload was sent

    def upload(
        self, items: Iterable[Item], on_placed: Callable[[Any, Placement], None]
    ) -> list[UploadedObject]:
        """Upload ``(index, bytes, block CRC32Cs or None)`` items in order; returns the
        objects. Where each item went is told only to ``on_placed(index, placement)``, as
        soon as the item has its place and before the next item is taken: the caller keeps
        what it needs of it, and nothing is collected twice."""
        streams: list[ObjectStream] = []
        try:
            for index, data, crcs in items:
                if not streams or (
                    streams[-1].size and streams[-1].size + len(data) > self.max_object_size
                ):
                    if streams:
                        streams[-1].finish()
                    streams.append(self._open(len(streams), len(data)))
                offset = streams[-1].add(data, crcs)
                on_placed(index, Placement(len(streams) - 1, offset, len(data)))
            if streams:
                streams[-1].finish()
            results = [stream.completion.result() for stream in streams]  # type: ignore[union-attr]
        except BaseException as exc:
            self._fail(exc)
            self._clean_up()
            raise self._error from None  # type: ignore[misc]
        return results

    def _open(self, number: int, first_item: int) -> ObjectStream:
        """A new object, its parts sized for the largest it can grow to: the usual bound,
        or its first item where that alone is larger (an item gets an object of its own)."""
        key = self.object_key(number)
        self._planned_keys.append(key)
        largest = max(self.object_size_hint, first_item)
        return ObjectStream(self, key, *part_limits(largest, self.store.config.part_size))

    # -- producer side (calling thread) -----------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, Any], nbytes: int) -> Future[Any]:
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
        """Abort and delete what the save wrote, within a bound: :data:`CLEAN_UP_TIMEOUT_S`,
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

    # -- I/O side (event loop) --------------------------------------------------------

    async def _tracked(self, coro: Coroutine[Any, Any, Any]) -> Any:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await coro
        finally:
            self._tasks.discard(task)

    async def put(self, key: str, body: Body, checksum: int | None) -> UploadedObject:
        etag = await self.store.put(key, body, crc32c=checksum)
        return UploadedObject(key, len(body), etag)

    async def create(self, key: str) -> str:
        def record(upload_id: str) -> None:  # also when this task is cancelled meanwhile
            self._upload_ids[key] = upload_id

        self._created.append(key)

        return await self._unstoppable(self.store.create_multipart(key), record)

    async def parts(
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

    async def complete(
        self,
        key: str,
        size: int,
        created: Future[str],
        batches: list[Future[list[PartResult]]],
    ) -> UploadedObject:
        upload_id = await result_of(created)
        results = [part for b in batches for part in await result_of(b)]
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
        aborts = [lambda k=k, u=u: abort_upload(self.store, k, u) for k, u in known.items()]
        aborts += [lambda k=k: abort_listed_uploads(self.store, k) for k in unanswered]
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
