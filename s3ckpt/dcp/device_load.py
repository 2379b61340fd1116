"""Loads into device memory: every byte passes through a few pinned host slabs.

The network writes only into host memory, and a load into CUDA tensors must not hold the
rank's whole state there: an item whose destination is in device memory
(:func:`~s3ckpt.dcp.restore.through_slabs`) is cut into block-aligned pieces of at most
one slab. Each piece is received into a free slab (page-locked where CUDA is available,
so the copy to the device is an asynchronous DMA), its block CRC32Cs are checked as it
streams, and the load's own thread copies it to the device while the event loop receives
the next pieces. A slab goes back to the free set once its copy has completed (a CUDA
event); the download waits for one when all are taken (the download's byte budget, one
slab per piece). Host memory for the load: the slabs (``bounce_bytes``, 256 MiB by default)
however large the state, plus the items under
:data:`~s3ckpt.dcp.restore.SLAB_MIN_ITEM` (norms, biases), which keep a buffer of their own.

A destination that takes the stored bytes as they are (contiguous, the stored dtype, the
whole chunk) receives the pieces straight into its memory. The others (a region of a
resharded chunk, a non-contiguous view, another dtype) get a device scratch buffer for
the item while it is in flight, narrowed and copied on the device when it is complete.

A shared read carried in device memory (:mod:`s3ckpt.dcp.shared_read`) uses the same
slabs, and :func:`receive_into` and :func:`onto_device` for the bytes that arrive from or
leave for another rank's device.

A piece whose bytes fail their check is read again into the same slab (up to
:data:`~s3ckpt.transfer.download.REREADS` times) before anything is copied: only verified
bytes reach the device. The slabs are kept for the process's next load (pinning memory
costs far more than copying through it), one set per load running at the time.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections import deque
from dataclasses import dataclass

import torch

from s3ckpt.dcp.restore import PendingRead, as_bytes_tensor, verify_received
from s3ckpt.dcp.tensor_bytes import tensor_view
from s3ckpt.errors import CorruptCheckpointError
from s3ckpt.format.checksums import StreamingCheck
from s3ckpt.transfer.download import REREADS, Downloader, ReadTarget

MiB = 1024 * 1024
DEFAULT_BOUNCE_BYTES = 256 * MiB
log = logging.getLogger(__name__)


class Slabs:
    """Fixed-size host buffers that pieces are received into.

    ``free`` is taken from on the event loop (when a piece's first byte arrives) and given
    back to on the load's thread; ``list.pop`` and ``list.append`` are atomic, and the
    download's budget admits no more pieces than there are slabs.
    """

    def __init__(self, size: int, count: int, pinned: bool) -> None:
        self.size = size
        self.pinned = pinned
        self.tensors = [
            torch.empty(size, dtype=torch.uint8, pin_memory=pinned) for _ in range(count)
        ]
        self.views = [tensor_view(t) for t in self.tensors]
        self.free = list(range(count))

    @property
    def budget(self) -> int:
        return self.size * len(self.tensors)

    def take(self) -> int:
        return self.free.pop()

    def reset(self) -> None:
        """Every slab free again (after a load, including one that failed mid-piece)."""
        self.free[:] = range(len(self.tensors))


_kept: dict[int, list[Slabs]] = {}  # by pid: a forked child pins its own
_kept_lock = threading.Lock()


def checkout(size: int, budget: int, pinned: bool) -> Slabs:
    """Slabs of ``size`` bytes, ``budget`` bytes of them (at least two), for one load."""
    count = max(2, budget // size)
    with _kept_lock:
        kept = _kept.setdefault(os.getpid(), [])
        for slabs in kept:
            if (slabs.size, len(slabs.tensors), slabs.pinned) == (size, count, pinned):
                kept.remove(slabs)
                return slabs
    return Slabs(size, count, pinned)


def give_back(slabs: Slabs) -> None:
    """Keep ``slabs`` for the next load; only the last set given back is kept."""
    slabs.reset()
    with _kept_lock:
        _kept[os.getpid()] = [slabs]


def slab_size(items: list[PendingRead], request_size: int) -> int:
    """Slabs as large as a request, and a whole number of every item's checksum blocks."""
    block = max(item.stored.block_size for item in items)
    return max(block, request_size // block * block)


def device_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """Bytes in ``device`` memory for an item that cannot land in its destination."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def receive_into(item: PendingRead) -> None:
    """Device memory for ``item``'s bytes: its destination's, when they are the span, else
    a device buffer; whatever host buffer it had is dropped."""
    assert item.destination is not None
    nbytes = item.span[1] - item.span[0]
    device = item.destination.device
    if item.in_place:
        item.raw = as_bytes_tensor(item.destination)
    else:
        item.raw = device_buffer(nbytes, device)
    item.raw_view = memoryview(b"")
    item.direct = item.in_place
    item.scratch_at_decode = False


def onto_device(item: PendingRead) -> None:
    """Move a verified item's bytes into device memory if they are in host memory (it was
    decoded there, or is too small for the slabs)."""
    assert item.destination is not None
    if item.raw.device == item.destination.device:
        return  # it came through the slabs, or the host is its device
    host = item.raw
    receive_into(item)
    item.raw.copy_(host)  # from pageable memory: complete when it returns


@dataclass(eq=False)
class Piece:
    """Bytes ``[within, within + nbytes)`` of an item's raw span, on their way to the device."""

    item: PendingRead
    key: str
    start: int  # in the object
    within: int
    nbytes: int
    check: StreamingCheck
    slab: int = -1


class DeviceFeed:
    """The pieces of one load's device items: their targets, their checks, their copies.

    ``download`` fetches the pieces: each slab copied out goes back to its budget, and a
    damaged piece is fetched again through it, on fresh connections.
    """

    def __init__(self, slabs: Slabs, download: Downloader) -> None:
        self.slabs = slabs
        self.download = download
        self._left: dict[int, int] = {}  # id(item) -> pieces not landed yet
        self._copying: deque[tuple[torch.cuda.Event | None, int]] = deque()

    def targets(self, item: PendingRead, key: str) -> list[ReadTarget]:
        """The read targets of ``item``'s pieces (one empty target for an empty item)."""
        first, last = item.span
        block = item.stored.block_size
        step = self.slabs.size // block * block
        base = item.stored.offset + first
        pieces = []
        for within in range(0, max(last - first, 1), step):
            nbytes = min(step, last - first - within)
            check = StreamingCheck(item.stored.crc32c, block, (first + within) // block, nbytes)
            pieces.append(Piece(item, key, base + within, within, nbytes, check))
        self._left[id(item)] = len(pieces)
        return [self._target(piece) for piece in pieces]

    def _target(self, piece: Piece) -> ReadTarget:
        return ReadTarget(
            piece.key,
            piece.start,
            piece.start + piece.nbytes,
            None,
            piece,
            piece.check,
            functools.partial(self._allocate, piece),
            reserve=self.slabs.size,
        )

    def _allocate(self, piece: Piece) -> memoryview:
        """A slab for ``piece`` (on the event loop, as its first byte arrives)."""
        piece.slab = self.slabs.take()
        return self.slabs.views[piece.slab][: piece.nbytes]

    def land(self, piece: Piece) -> PendingRead | None:
        """Verify a piece that has arrived and copy it to the device; the item, once its
        last piece has been copied (the copies are queued on the device's stream, ahead of
        anything the planner does with the tensor)."""
        item = piece.item
        if piece.nbytes:
            self._verify(piece)
            self._copy(piece)
        self._left[id(item)] -= 1
        if self._left[id(item)]:
            return None
        del self._left[id(item)]
        return item

    def _verify(self, piece: Piece) -> None:
        view = self.slabs.views[piece.slab][: piece.nbytes]
        for attempt in range(REREADS + 1):
            try:
                verify_received(piece.check, view, piece.item.stored, piece.item.what)
                return
            except CorruptCheckpointError as damage:
                if attempt == REREADS:
                    raise
                log.warning("%s; reading it again (%d of %d)", damage, attempt + 1, REREADS)
                stored = piece.item.stored
                piece.check = StreamingCheck(
                    stored.crc32c, stored.block_size, piece.check.first_block, piece.nbytes
                )
                again = ReadTarget(piece.key, piece.start, piece.start + piece.nbytes, view,
                                   piece, piece.check)  # fmt: skip
                self.download.fetch_again([again])

    def _copy(self, piece: Piece) -> None:
        item = piece.item
        if item.raw.numel() == 0:  # not direct: a device buffer for the item while in flight
            assert item.destination is not None
            item.raw = device_buffer(item.span[1] - item.span[0], item.destination.device)
        source = self.slabs.tensors[piece.slab][: piece.nbytes]
        item.raw[piece.within : piece.within + piece.nbytes].copy_(
            source, non_blocking=self.slabs.pinned
        )
        event = None
        if item.raw.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(item.raw.device))
        self._copying.append((event, piece.slab))
        self.give_back_copied()

    def give_back_copied(self, wait: bool = False) -> bool:
        """Return the slabs whose copies have completed; ``wait``: wait for the oldest copy
        first if none has. Whether any slab was returned."""
        returned = False
        while self._copying:
            event, slab = self._copying[0]
            if event is not None and not event.query():
                if not wait:
                    break
                event.synchronize()
                wait = False
            self._copying.popleft()
            self.slabs.free.append(slab)
            self.download.release(self.slabs.size)
            returned = True
        return returned

    def close(self) -> None:
        """Wait for every copy still queued: no slab is reused, nor a load returns, while a
        copy from it may still run."""
        for event, _ in self._copying:
            if event is not None:
                event.synchronize()
        self._copying.clear()
