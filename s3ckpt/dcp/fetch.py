"""One ``read_data``'s items: fetched, verified, read again if damaged, handed to the planner.

:mod:`s3ckpt.dcp.restore` decides where each item's bytes land; this module runs the
download (:class:`~s3ckpt.transfer.download.Downloader`) over all of them at once and
finishes each item as its last byte arrives, on the thread that runs DCP's load:

* raw items were checked as they streamed (:func:`~s3ckpt.dcp.restore.verify_streamed`);
* compressed ones are decoded and checked by the decode workers (small ones inline, where
  a worker costs more than decoding), their frames held to :data:`FRAMES_BUDGET`;
* items into device memory arrive as pieces through bounce slabs
  (:mod:`s3ckpt.dcp.device_load`), each checked and copied to the device as it lands.

An item whose bytes fail their check is read again, up to
:data:`~s3ckpt.transfer.download.REREADS` times on fresh connections, before its damage is
believed. Nothing writes into a destination once :meth:`ItemFetch.run` has returned or
raised: decode workers are waited for, and so are copies to the device.
"""

from __future__ import annotations

import functools
import logging
import queue
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

import torch

from s3ckpt.config import S3URI
from s3ckpt.dcp import device_load
from s3ckpt.dcp.compat import LoadPlanner
from s3ckpt.dcp.device_load import DeviceFeed, Piece
from s3ckpt.dcp.restore import (
    FramePool,
    PendingRead,
    decode,
    decode_pool,
    hand_to_planner,
    verify_streamed,
)
from s3ckpt.errors import CorruptCheckpointError
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.download import NOTHING_YET, REREADS, Downloader, ReadTarget

INLINE_DECODE_BYTES = 64 * 1024
# Compressed frames received but not yet decoded, at most (see download.Downloader).
FRAMES_BUDGET = 64 * 1024 * 1024
log = logging.getLogger(__name__)

Checked = tuple[PendingRead, CorruptCheckpointError | None]


@dataclass(frozen=True)
class ReadSource:
    """Where and how a load's fetches read (:class:`~s3ckpt.dcp.reader.S3StorageReader`'s
    store, location and options)."""

    store: ObjectStore
    location: S3URI
    request_size: int
    bounce_bytes: int
    decode_threads: int
    trust_pickles: bool


@dataclass(frozen=True)
class ReadPlan:
    """One ``read_data`` as data, built once by the reader before any byte moves: every
    item's stored range, destination and checks (:class:`~s3ckpt.dcp.restore.PendingRead`),
    and where and how to fetch them. The layers below run it and return; none calls back."""

    items: list[PendingRead]
    source: ReadSource


class ItemFetch:
    """The fetch of one ``read_data`` from ``source``."""

    def __init__(self, source: ReadSource) -> None:
        self.source = source

    def run(
        self,
        pending: list[PendingRead],
        planner: LoadPlanner,
        keep: frozenset[int] = frozenset(),
        onto_device: frozenset[int] = frozenset(),
    ) -> dict[int, PendingRead]:
        """Fetch, verify (reading damaged items again) and hand over every item; those
        whose ``id`` is in ``keep`` are verified but kept, returned by that ``id``, and
        those also in ``onto_device`` moved into device memory as each is verified
        (:func:`~s3ckpt.dcp.device_load.onto_device`: its host buffer is dropped then,
        not after the whole fetch)."""
        staged = [p for p in pending if p.staged]
        slabs = self._slabs(staged) if staged else None
        ranges = self._downloader(None if slabs is None else slabs.budget)
        feed = None if slabs is None else DeviceFeed(slabs, ranges)
        frames = FramePool()
        targets: list[ReadTarget] = []
        for p in pending:
            if feed is not None and p.staged:
                targets += feed.targets(p, self._key(p))
            else:
                targets.append(self._target(p, frames, ranges))
        decoded: queue.SimpleQueue[ThreadFuture[Checked]] = queue.SimpleQueue()
        submitted: list[ThreadFuture[Checked]] = []
        pool = decode_pool(self.source.decode_threads)
        kept: dict[int, PendingRead] = {}

        def settle(checked: Checked) -> None:
            item = self._settled(checked)
            if id(checked[0]) in keep:
                if id(checked[0]) in onto_device:
                    device_load.onto_device(item)
                kept[id(checked[0])] = item
            else:
                hand_to_planner(item, planner, trust_pickles=self.source.trust_pickles)

        handed_over = 0
        try:
            polled = feed is not None  # then slabs return between tokens, as copies finish
            for token in ranges.fetch(targets, polled):
                if token is NOTHING_YET:  # slabs whose copies are done go back to the budget
                    if feed is not None:
                        feed.give_back_copied(wait=True)
                    continue
                if isinstance(token, Piece):  # verified and copied to the device here
                    landed = feed.land(token) if feed is not None else None
                    if landed is not None:
                        settle((landed, None))
                    continue
                item: PendingRead = token  # type: ignore[assignment]
                if item.compressed and len(item.view) > INLINE_DECODE_BYTES:
                    submitted.append(pool.submit(_checked, item))
                    submitted[-1].add_done_callback(decoded.put)
                else:  # small compressed items: a worker costs more than decoding here
                    settle(_checked(item))
                while not decoded.empty():
                    settle(decoded.get().result())
                    handed_over += 1
            for _ in range(len(submitted) - handed_over):
                settle(decoded.get().result())
        finally:
            for waiting in submitted:
                waiting.cancel()
            futures_wait(submitted)  # no worker may write into a destination after this returns
            if feed is not None and slabs is not None:
                feed.close()  # nor a copy from a slab still run
                device_load.give_back(slabs)
        return kept

    def _slabs(self, staged: list[PendingRead]) -> device_load.Slabs:
        size = device_load.slab_size(staged, self.source.request_size)
        return device_load.checkout(size, self.source.bounce_bytes, torch.cuda.is_available())

    def _downloader(self, budget: int | None = None) -> Downloader:
        request_size = self.source.request_size
        return Downloader(
            self.source.store,
            max_request_size=request_size,
            lazy_budget=budget or max(FRAMES_BUDGET, 4 * request_size),
        )

    def _key(self, item: PendingRead) -> str:
        return self.source.location.key(item.stored.key)

    def _target(self, item: PendingRead, frames: FramePool, ranges: Downloader) -> ReadTarget:
        return ReadTarget(
            self._key(item),
            item.stored.offset + item.stored_span[0],
            item.stored.offset + item.stored_span[1],
            None if item.compressed else item.view,
            item,
            item.check,
            functools.partial(item.frames_buffer, frames, ranges.release)
            if item.compressed
            else None,
        )

    def _settled(self, checked: Checked) -> PendingRead:
        """A fetched item whose bytes passed their check (read again if they did not)."""
        item, damage = checked
        return item if damage is None else self._read_again(item, damage)

    def _read_again(self, item: PendingRead, damage: CorruptCheckpointError) -> PendingRead:
        """Read an item whose bytes failed their checksum again, up to :data:`REREADS`
        times, each on fresh connections: a mismatch in a GET body is most often damage in
        transit. An item that stays damaged is a damaged object: ``damage`` is raised."""
        for attempt in range(1, REREADS + 1):
            log.warning("%s; reading it again (%d of %d)", damage, attempt, REREADS)
            # Staged items are read again piece by piece (DeviceFeed): this one was not.
            fresh = item.renewed()
            ranges = self._downloader()
            ranges.fetch_again([self._target(fresh, FramePool(), ranges)])
            fresh, again = _checked(fresh)
            if again is None:
                return fresh
        raise damage


def _checked(item: PendingRead) -> Checked:
    """A fetched item verified (compressed ones decoded and verified); the damage found,
    if any, instead of raising it, so that the caller can read the item again."""
    try:
        if item.compressed:
            decode(item)
        else:
            verify_streamed(item)
    except CorruptCheckpointError as exc:
        return item, exc
    return item, None
