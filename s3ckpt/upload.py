"""The upload engine: a rank's planned objects become PUTs and multipart uploads.

The calling thread walks the items in layout order, resolving each lazily (a GPU tensor
is copied to the CPU only when its turn comes), and cuts the byte stream into parts.
A part that lies inside one tensor is sent as a ``memoryview`` of that tensor's memory;
only parts straddling item boundaries are joined into a fresh buffer. Each part becomes a
small task on the I/O loop, so parts of every object upload concurrently under the
process-wide request bound, while a byte budget keeps the producer from running too far
ahead of the network.

Nothing is left behind on failure or cancellation: every task is cancelled and awaited,
every multipart upload this save created is aborted (also ones whose CreateMultipartUpload
response never arrived: they are found by listing the save's unique keys), and objects
already completed are deleted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from crc32c import crc32c

from s3ckpt.layout import ObjectPlan, Slot
from s3ckpt.loop import io_loop
from s3ckpt.parts import choose_part_size, cut_parts, is_multipart
from s3ckpt.store import Body, ObjectStore, PartResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UploadedObject:
    key: str
    size: int
    etag: str


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
    """Uploads the objects of one rank's save. Use once, from one thread."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._loop = io_loop()
        self._budget = _shared_budget(store.config.max_bytes_in_flight)
        self._futures: list[Future[Any]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._upload_ids: dict[str, str] = {}
        self._error: BaseException | None = None
        self._planned_keys: list[str] = []

    def upload(
        self,
        objects: list[ObjectPlan],
        key_of: Callable[[str], str],
        read: Callable[[Slot], memoryview],
    ) -> list[UploadedObject]:
        """Upload every object; ``read(slot)`` returns the bytes of one item."""
        completions: list[Future[UploadedObject]] = []
        try:
            for plan in objects:
                key = key_of(plan.key)
                self._planned_keys.append(key)
                completions.append(self._upload_object(key, plan, read))
            results = [f.result() for f in completions]
        except BaseException as exc:
            self._fail(exc)
            self._clean_up()
            raise self._error from None  # type: ignore[misc]
        return results

    # -- producer side (calling thread) -----------------------------------------------

    def _upload_object(
        self, key: str, plan: ObjectPlan, read: Callable[[Slot], memoryview]
    ) -> Future[UploadedObject]:
        part_size = choose_part_size(plan.size, self.store.config.part_size)
        if not is_multipart(plan.size, part_size):
            body = _join([read(slot) for slot in plan.slots])
            return self._spawn(self._put(key, body), len(body))
        created = self._spawn(self._create(key), 0)
        parts = [
            self._spawn(self._part(key, created, number, body), len(body))
            for number, body in enumerate(_part_bodies(plan.slots, read, part_size), start=1)
        ]
        return self._spawn(self._complete(key, plan.size, created, parts), 0)

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
            self._loop.submit(self._abandon()).result(timeout=120)
        except Exception as exc:  # the original error matters more than a failed clean-up
            log.warning("clean-up after a failed save was incomplete: %s", exc)

    # -- I/O side (event loop) --------------------------------------------------------

    async def _tracked(self, coro: Coroutine[Any, Any, Any]) -> Any:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await coro
        finally:
            self._tasks.discard(task)

    async def _put(self, key: str, body: Body) -> UploadedObject:
        etag = await self.store.put(
            key, body, crc32c=crc32c(body) if self.store.config.checksums else None
        )
        return UploadedObject(key, len(body), etag)

    async def _create(self, key: str) -> str:
        upload_id = await self.store.create_multipart(key)
        self._upload_ids[key] = upload_id
        return upload_id

    async def _part(self, key: str, created: Future[str], number: int, body: Body) -> PartResult:
        upload_id = await asyncio.wrap_future(created)
        checksum = crc32c(body) if self.store.config.checksums else None
        return await self.store.upload_part(key, upload_id, number, body, checksum)

    async def _complete(
        self, key: str, size: int, created: Future[str], parts: list[Future[PartResult]]
    ) -> UploadedObject:
        upload_id = await asyncio.wrap_future(created)
        results = [await asyncio.wrap_future(p) for p in parts]
        etag = await self.store.complete_multipart(key, upload_id, results)
        self._upload_ids.pop(key, None)
        return UploadedObject(key, size, etag)

    async def _abandon(self) -> None:
        """Cancel everything in flight, abort this save's uploads, delete its objects."""
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for key in self._planned_keys:
            upload_ids = {self._upload_ids[key]} if key in self._upload_ids else set()
            async for pending in self.store.list_multipart_uploads(key):
                if pending.key == key:
                    upload_ids.add(pending.upload_id)
            for upload_id in upload_ids:
                await self.store.abort_multipart(key, upload_id)
        if self._planned_keys:
            await self.store.delete_many(self._planned_keys)


def _part_bodies(slots: list[Slot], read: Callable[[Slot], memoryview], part_size: int) -> Iterator[Body]:
    """Yield part bodies following :func:`~s3ckpt.parts.cut_parts`, reading items lazily.

    An item is read when its first piece is needed and forgotten after its last one, so a
    GPU tensor's CPU copy lives only as long as its parts are in flight.
    """
    plan = cut_parts([slot.length for slot in slots], part_size)
    last_use = {item: n for n, part in enumerate(plan) for item, _, _ in part}
    views: dict[int, memoryview] = {}
    for n, part in enumerate(plan):
        pieces = []
        for item, start, end in part:
            if item not in views:
                views[item] = read(slots[item])
            pieces.append(views[item][start:end])
        yield _join(pieces)
        for item, _, _ in part:
            if last_use[item] == n:
                views.pop(item, None)


def _join(pieces: list[memoryview]) -> Body:
    """One body from pieces: the piece itself when there is one (no copy), else a joined copy."""
    if len(pieces) == 1:
        return pieces[0]
    return b"".join(pieces)
