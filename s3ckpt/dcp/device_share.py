"""Shared ranges carried in device memory: no host buffer of an item's size on any rank.

Where a load's group carries device tensors for a destination's device type
(:func:`~s3ckpt.dcp.process_group.carriage`: NCCL for CUDA), a shared item bound for that
device's memory goes from the store to the device of the rank that fetches it, and from
there to the device memory of the ranks that need it:

* its owner fetches it through the bounce slabs of :mod:`s3ckpt.dcp.device_load`, as an
  unshared load would (pieces checked as they stream, read again if damaged, copied to
  the device), into its destination when the destination's memory is the stored bytes,
  else into a device buffer, and sends from there. An item that does not pass through
  slabs (under :data:`~s3ckpt.dcp.restore.SLAB_MIN_ITEM`, or compressed: the owner decodes
  it in host memory, checking every block) is copied to device memory as soon as it is
  verified (:func:`onto_device`), and its host buffer dropped;
* a receiver receives into its destination or a device buffer (:func:`receive_into`) and
  checks what arrived (:func:`check_received`): copied back to the host one slab at a time
  (pinned, at the copy engine's rate, the next piece copying while one is checked), each
  piece's block CRC32Cs compared with the stored ones. The owner's check covers the store
  to the owner; this one covers what came after: the owner's device memory, the transport
  between the ranks and the receiver's own memory. Its cost is one device-to-host copy
  and one CRC32C of the bytes each rank receives.

Host memory for these items is the slabs (``bounce_bytes``), the items under
``SLAB_MIN_ITEM``, and compressed items while they are decoded, as in an unshared load.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch

from s3ckpt.dcp import device_load
from s3ckpt.dcp.restore import PendingRead, as_bytes_tensor
from s3ckpt.format.checksums import verify_blocks

Received = tuple[PendingRead, int]  # (item, the rank it came from)
_Piece = tuple[PendingRead, int, int, int]  # (item, sender, first byte in the span, bytes)


def receive_into(item: PendingRead) -> None:
    """Device memory for ``item``'s bytes: its destination's, when they are the span, else
    a device buffer; whatever host buffer it had is dropped."""
    assert item.destination is not None
    nbytes = item.span[1] - item.span[0]
    device = item.destination.device
    if item.in_place:
        item.raw = as_bytes_tensor(item.destination)
    else:
        item.raw = device_load.device_buffer(nbytes, device)
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


def check_received(received: list[Received], slabs: device_load.Slabs) -> None:
    """Raise :class:`~s3ckpt.errors.CorruptCheckpointError` unless every block that
    arrived in device memory matches its stored CRC32C, copied back through ``slabs``."""
    queued: deque[tuple[torch.cuda.Event | None, int, _Piece]] = deque()
    for number, piece in enumerate(_pieces(received, slabs.size)):
        slab = number % len(slabs.tensors)
        if len(queued) == len(slabs.tensors):  # the oldest copy holds this slab
            _check(queued.popleft(), slabs)
        item, _, within, nbytes = piece
        slabs.tensors[slab][:nbytes].copy_(
            item.raw[within : within + nbytes], non_blocking=slabs.pinned
        )
        event = None
        if item.raw.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(item.raw.device))
        queued.append((event, slab, piece))
    while queued:
        _check(queued.popleft(), slabs)


def _pieces(received: list[Received], size: int) -> Iterator[_Piece]:
    for item, sender in received:
        step = size // item.stored.block_size * item.stored.block_size
        total = item.span[1] - item.span[0]
        for within in range(0, total, step):
            yield item, sender, within, min(step, total - within)


def _check(copied: tuple[torch.cuda.Event | None, int, _Piece], slabs: device_load.Slabs) -> None:
    event, slab, (item, sender, within, nbytes) = copied
    if event is not None:
        event.synchronize()
    block = item.stored.block_size
    verify_blocks(
        slabs.views[slab][:nbytes],
        item.stored.crc32c,
        block_size=block,
        first_block=(item.span[0] + within) // block,
        what=f"{item.what} (passed on by rank {sender})",
    )
