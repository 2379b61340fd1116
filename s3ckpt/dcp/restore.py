"""From a DCP read item to a loaded tensor: where its bytes land, and how they get there.

For every read item of a load, :func:`prepare` decides

* which raw bytes of the stored chunk are needed: all of them, or, when resharding asks
  for a region that is one contiguous byte range (whole rows), just that range;
* which checksum blocks cover them (only whole blocks can be verified), and which stored
  bytes hold those blocks (the same range for raw items; the blocks' frames for
  compressed ones);
* where the bytes land: straight into the destination tensor when it is a contiguous CPU
  tensor of the stored dtype and the whole chunk is read; through the bounce slabs of
  :mod:`s3ckpt.dcp.device_load` when it is in device memory; else a scratch buffer (for
  compressed items, allocated when they are decoded, so only items in flight hold one).

Raw items are verified while they stream in (:class:`~s3ckpt.format.checksums.StreamingCheck`);
compressed items are decoded and verified by :func:`decode`, in a worker thread.
:func:`hand_to_planner` then copies or narrows into the destination if needed and hands the result
to the planner, on the calling thread.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from s3ckpt.dcp.compat import LoadItemType, LoadPlanner, ReadItem, narrow
from s3ckpt.dcp.tensor_bytes import byte_buffer, tensor_from_bytes, tensor_view
from s3ckpt.errors import CorruptCheckpointError, UntrustedPickleError
from s3ckpt.format.checksums import StreamingCheck, check_block, verify_blocks
from s3ckpt.format.compression import CODECS, RAW, decode_block
from s3ckpt.format.layout import StoredItem


@dataclass(eq=False)
class PendingRead:
    """One read item on its way.

    Every view is made here, on the thread that plans the load, before any byte moves:
    a torch call releases and retakes the GIL, which under the load's contention costs
    more than the call, so the event loop and the decode workers touch only memoryviews
    and numpy arrays.
    """

    request: ReadItem
    stored: StoredItem
    chunk: tuple[torch.dtype, torch.Size] | None  # stored dtype and shape; None for BYTE_IO
    span: tuple[int, int]  # block-aligned raw byte range of the item that is needed
    wanted: tuple[int, int] | None  # the contiguous raw sub-range needed; None: whole chunk
    raw: torch.Tensor  # uint8 raw bytes of the span: the destination's own memory if direct
    destination: torch.Tensor | None  # None for BYTE_IO
    direct: bool
    what: str  # names the object and the item in errors
    # Received through bounce slabs (device destinations): ``raw`` is the destination's
    # bytes (direct) or a device scratch buffer made when the first piece lands.
    staged: bool = False
    scratch_at_decode: bool = False  # compressed, not direct: ``raw`` is allocated by decode
    # The destination's own memory, as bytes, is the span (on any device): bytes carried
    # in device memory may land there (``dcp.shared_read``).
    in_place: bool = False
    stored_span: tuple[int, int] = field(init=False)  # stored bytes fetched, relative to the item
    raw_view: memoryview = field(init=False)  # over ``raw``
    view: memoryview = field(init=False)  # receives the stored bytes
    check: StreamingCheck | None = field(init=False)
    pool: FramePool | None = field(init=False, default=None)
    frames: np.ndarray | None = field(init=False, default=None)  # compressed: from the pool
    returned: Callable[[int], None] = field(init=False, repr=False)  # see frames_buffer

    def __post_init__(self) -> None:
        if self.stored.codec not in CODECS:
            raise CorruptCheckpointError(f"{self.what} uses unknown codec {self.stored.codec!r}")
        first, last = self.span
        self.stored_span = self.stored.stored_span(first, last)
        compressed = self.stored.codec != RAW
        self.raw_view = memoryview(b"") if self.staged else tensor_view(self.raw)
        # Compressed frames get their memory when the first byte arrives (frames_buffer).
        self.view = memoryview(b"") if compressed else self.raw_view
        block = self.stored.block_size
        self.check = (
            None
            if compressed
            else StreamingCheck(self.stored.crc32c, block, first // block, last - first)
        )

    @property
    def compressed(self) -> bool:
        return self.stored.codec != RAW

    def renewed(self) -> PendingRead:
        """The same read, ready to receive its bytes again into the same memory (after
        they failed their check): a fresh streaming check, frames taken anew."""
        return dataclasses.replace(self)

    def allocate_scratch(self) -> None:
        """Give a compressed item its raw scratch buffer now, if it waits for one."""
        if self.scratch_at_decode:
            self.raw = byte_buffer(self.span[1] - self.span[0])
            self.raw_view = tensor_view(self.raw)
            self.scratch_at_decode = False

    def frames_buffer(self, pool: FramePool, returned: Callable[[int], None]) -> memoryview:
        """Memory for a compressed item's frames, from ``pool`` (called as bytes arrive).

        ``returned(size)`` is called once the frames are decoded and their memory is back
        in the pool (the download's budget for frames awaiting decoding).
        """
        size = self.stored_span[1] - self.stored_span[0]
        self.frames = pool.take(size)
        self.pool = pool
        self.returned = returned
        self.view = memoryview(self.frames)[:size]
        return self.view

    def release_frames(self) -> None:
        """Give a compressed item's frame memory back, as soon as it is decoded."""
        if self.pool is not None and self.frames is not None:
            self.pool.give(self.frames)
            self.returned(len(self.view))
        self.view = memoryview(b"")
        self.pool = self.frames = None

    def release(self) -> None:
        """Drop the buffers once handed over, so a load holds only the items in flight."""
        self.release_frames()
        self.raw = _EMPTY
        self.raw_view = memoryview(b"")


_EMPTY = torch.empty(0, dtype=torch.uint8)
MiB = 1024 * 1024
_POOLED = 64 * 1024  # smaller frames are neither rounded up nor kept


class FramePool:
    """Receive buffers for compressed frames, reused within one load.

    A socket read into memory the process has not touched yet takes a page fault per
    page, which on a VM costs more than the copy itself; reusing the buffers of frames
    already decoded avoids that and bounds the memory a compressed load holds. Buffers are
    kept by size class (steps of an eighth of a power of two), so frames of similar size
    share them; frames under 64 KiB come from the allocator's heap as they are. With the
    download's budget for frames awaiting decoding, a load touches about that budget's
    worth of receive memory, however large the checkpoint.
    """

    def __init__(self, max_bytes: int = 256 * MiB) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Bytes kept for reuse."""
        return self._held

    def take(self, nbytes: int) -> np.ndarray:
        """A ``uint8`` buffer of at least ``nbytes`` bytes."""
        size = _size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                self._held -= size
                return free.pop()
        return np.empty(size, dtype=np.uint8)

    def give(self, buffer: np.ndarray) -> None:
        """Return a buffer from :meth:`take` (kept while the pool is under its bound)."""
        size = buffer.nbytes
        if size < _POOLED:
            return
        with self._lock:
            if self._held + size <= self.max_bytes:
                self._free.setdefault(size, []).append(buffer)
                self._held += size


def _size_class(nbytes: int) -> int:
    if nbytes < _POOLED:
        return nbytes
    step = 1 << (nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


Stage = bool | Callable[[torch.device], bool]
"""Whether a device destination's bytes pass through bounce slabs (``True``: wherever
:func:`through_slabs` says), for every destination or by its device."""


def prepare(request: ReadItem, stored: StoredItem, chunk: tuple[torch.dtype, torch.Size] | None,
            planner: LoadPlanner, what: str, *, stage: Stage = True) -> PendingRead:  # fmt: skip
    """Where ``request``'s bytes will land. ``stage`` false (or false for the destination's
    device): device destinations get a host scratch buffer now instead of bounce slabs (a
    shared read passes that buffer on over host memory)."""
    if request.type == LoadItemType.BYTE_IO or chunk is None:
        return PendingRead(
            request,
            stored,
            None,
            (0, stored.size),
            None,
            byte_buffer(stored.size),
            None,
            False,
            what,
        )
    dtype, shape = chunk
    wanted = contiguous_range(shape, request.storage_offsets, request.lengths, dtype.itemsize)
    first, last = stored.block_span(*(wanted or (0, stored.size)))
    destination = planner.resolve_tensor(request).detach()
    whole = wanted == (0, stored.size) or (
        wanted is None and tuple(request.lengths) == tuple(shape)
    )
    takes_bytes = whole and takes_stored_bytes(destination, dtype, stored.size)
    staged = stage(destination.device) if callable(stage) else stage
    if staged and stored.codec == RAW and through_slabs(destination, last - first):
        raw = as_bytes_tensor(destination) if takes_bytes else _EMPTY
        return PendingRead(request, stored, chunk, (first, last), wanted, raw, destination,
                           takes_bytes, what, staged=True, in_place=takes_bytes)  # fmt: skip
    direct = takes_bytes and destination.device.type == "cpu"
    later = stored.codec != RAW and not direct
    raw = as_bytes_tensor(destination) if direct else _EMPTY if later else byte_buffer(last - first)
    return PendingRead(request, stored, chunk, (first, last), wanted, raw, destination, direct,
                       what, scratch_at_decode=later, in_place=takes_bytes)  # fmt: skip


# Device destinations smaller than this keep a host scratch buffer of their own: their
# requests are then coalesced with their neighbours', where a bounce slab would take one
# request (and a whole slab) each. Norms and biases, a small part of any model's bytes.
SLAB_MIN_ITEM = 1024 * 1024


def through_slabs(destination: torch.Tensor, nbytes: int) -> bool:
    """Whether an item's bytes pass through bounce slabs: a destination the network cannot
    write into (device memory), and an item large enough to be worth a slab."""
    return destination.device.type != "cpu" and nbytes >= SLAB_MIN_ITEM


def decode(pending: PendingRead) -> PendingRead:
    """Decode a compressed item's frames into its raw buffer and verify them (thread-safe).

    Each block is checked against its CRC32C as it is decoded: the decoder computes the
    checksum in the same pass. The frame memory goes back as soon as decoding ends, even
    when it fails: downloads waiting for the frames budget depend on it.
    """
    pending.allocate_scratch()
    stored, raw, size = pending.stored, pending.raw_view, pending.stored.block_size
    first_block = pending.span[0] // size
    position = 0
    try:
        for n, start in enumerate(range(0, len(raw), size)):
            block = first_block + n
            frame = stored.frames[block]
            crc = decode_block(pending.view[position : position + frame], stored.codec,
                               raw[start : start + size])  # fmt: skip
            check_block(crc, stored.crc32c, block, first_block=first_block, block_size=size,
                        length=len(raw), what=pending.what)  # fmt: skip
            position += frame
    finally:
        pending.release_frames()
    return pending


_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}


def decode_pool(threads: int) -> ThreadPoolExecutor:
    """The process's decode workers, kept between loads so that their zstd contexts and
    memory stay warm (keyed by pid: a forked child starts its own)."""
    key = (os.getpid(), threads)
    pool = _pools.get(key)
    if pool is None:
        pool = _pools.setdefault(
            key, ThreadPoolExecutor(threads, thread_name_prefix="s3ckpt-decode")
        )
    return pool


def verify_streamed(pending: PendingRead) -> None:
    """Raise if a raw item's in-flight check failed; check it now if it could not stream."""
    assert pending.check is not None
    verify_received(pending.check, pending.view, pending.stored, pending.what)


def verify_received(check: StreamingCheck, data: memoryview, stored: StoredItem, what: str) -> None:
    """Raise if ``check`` (over the bytes received into ``data``) failed; check ``data``
    now if the check could not follow the bytes as they streamed."""
    if not check.active:
        verify_blocks(data, stored.crc32c, block_size=stored.block_size,
                      first_block=check.first_block, what=what)  # fmt: skip
    elif check.bad_block is not None:
        raise CorruptCheckpointError(f"checksum mismatch in {what} (block {check.bad_block})")


def hand_to_planner(
    pending: PendingRead, planner: LoadPlanner, *, trust_pickles: bool = False
) -> None:
    """Hand a verified item to the planner (on the thread that runs DCP's load)."""
    if pending.destination is None:
        data = pending.raw_view.tobytes()
        if not trust_pickles:
            _check_pickle(data, pending.what)
        planner.load_bytes(pending.request, io.BytesIO(data))
    else:
        if not pending.direct:
            pending.destination.copy_(_source(pending))
        planner.commit_tensor(pending.request, pending.destination)
    pending.release()


# Classes DCP writes as values that torch's default allowlist lacks. io.BytesIO: DCP saves a
# BytesIO in a state dict (a loss history, a serialized object) by pickling it; unpickling
# one only makes a BytesIO of the stored bytes.
SAFE_VALUE_CLASSES: list[Any] = [io.BytesIO]


def _check_pickle(data: bytes, what: str) -> None:
    """Refuse a non-tensor item that torch's weights-only unpickler would not load.

    DCP's planners unpickle non-tensor items with ``torch.load(weights_only=False)``,
    which runs whatever the pickle says: a hostile bucket could run code. Loading the
    bytes with the weights-only allowlist first (plain Python values, containers,
    tensors) makes sure the second, unrestricted load has nothing dangerous to run.
    :data:`SAFE_VALUE_CLASSES` adds what DCP's own planners write beyond those.
    """
    try:
        with torch.serialization.safe_globals(SAFE_VALUE_CLASSES):
            torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise UntrustedPickleError(
            f"{what} holds objects outside torch's weights-only allowlist and was not loaded "
            f"(pass trust_pickles=True to S3StorageReader to load it anyway): {exc}"
        ) from exc


def _source(pending: PendingRead) -> torch.Tensor:
    assert pending.chunk is not None
    dtype, shape = pending.chunk
    first = pending.span[0]
    if pending.wanted is not None:
        start, end = pending.wanted
        return tensor_from_bytes(
            pending.raw[start - first : end - first], dtype, tuple(pending.request.lengths)
        )
    chunk = tensor_from_bytes(pending.raw, dtype, shape)
    return narrow(chunk, pending.request.storage_offsets, pending.request.lengths)


def contiguous_range(
    shape: torch.Size, offsets: torch.Size, lengths: torch.Size, itemsize: int
) -> tuple[int, int] | None:
    """Byte range of the region ``offsets``/``lengths`` in a C-contiguous chunk, if it is one range."""
    ndim = len(shape)
    if ndim == 0:
        return (0, itemsize)
    d = ndim - 1
    while d >= 0 and offsets[d] == 0 and lengths[d] == shape[d]:
        d -= 1
    if any(lengths[i] != 1 for i in range(d)):
        return None
    strides = [1] * ndim
    for i in range(ndim - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    numel = 1
    for n in lengths:
        numel *= n
    start = sum(o * s for o, s in zip(offsets, strides, strict=True)) * itemsize
    return (start, start + numel * itemsize)


def takes_stored_bytes(destination: torch.Tensor, dtype: torch.dtype, nbytes: int) -> bool:
    """Whether ``destination``'s own memory, as bytes, is the stored chunk (on any device)."""
    return (
        destination.dtype == dtype
        and destination.is_contiguous()
        and destination.numel() * destination.element_size() == nbytes
        and not destination.is_conj()
        and not destination.is_neg()
    )


def as_bytes_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat ``uint8`` tensor (zero-copy)."""
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
