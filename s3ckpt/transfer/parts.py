"""Cutting a data object into multipart parts as its items arrive, within S3's limits.

S3 (and FlashBlade) accept parts of 5 MiB to 5 GiB (the last may be smaller), at most
10,000 parts, and objects up to 5 TiB. The preferred size balances client CPU (very large
request bodies cost page faults and copies in the HTTP stack) against request count
(docs/decisions/0006-part-sizes.md). The part arithmetic is pure functions and
:class:`PartCutter`; :class:`ObjectStream` turns one object's items into the requests that
store it (:data:`Request`), returned as values for the uploader
(:class:`~s3ckpt.transfer.upload.RankUploader`) to queue as tasks: the stream calls
nothing and knows no uploader.

A batch of parts is sent by native threads as one call where the store can
(:mod:`s3ckpt.s3.wire.batch`), so the GIL changes hands per batch, not per part. A part
inside one item is sent as a ``memoryview`` of that item's memory; only parts straddling
item boundaries are joined into a fresh buffer (:func:`join`). Each part carries its
CRC32C: parts of an item are cut on its checksum blocks, so that CRC is combined from the
item's block CRC32Cs (computed once, for the manifest) instead of read from memory a
second time.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from s3ckpt.format.checksums import combine, crc_of, range_crc
from s3ckpt.s3.store import Body
from s3ckpt.transfer.thread_mode import joined

try:
    from s3ckpt.transfer import _gather
except ImportError:  # pragma: no cover - exercised where no C compiler is available
    _gather = None  # type: ignore[assignment]

MiB = 1024 * 1024
GiB = 1024 * MiB
TiB = 1024 * GiB

MIN_PART_SIZE = 5 * MiB
MAX_PART_SIZE = 5 * GiB
MAX_PARTS = 10_000
MAX_OBJECT_SIZE = 5 * TiB
DEFAULT_PART_SIZE = 16 * MiB


def choose_part_size(object_size: int, preferred: int | None = None) -> int:
    """The part size for an object of ``object_size`` bytes.

    ``preferred`` (default 16 MiB) is used unless the object would need more than 10,000
    parts, in which case the smallest MiB-aligned size that fits is used instead.
    """
    if object_size < 0:
        raise ValueError("object_size must be non-negative")
    if object_size > MAX_OBJECT_SIZE:
        raise ValueError(f"objects are limited to 5 TiB, got {object_size} bytes")
    size = preferred or DEFAULT_PART_SIZE
    size = min(max(size, MIN_PART_SIZE), MAX_PART_SIZE)
    if math.ceil(object_size / size) > MAX_PARTS:
        size = math.ceil(object_size / MAX_PARTS / MiB) * MiB
    return min(size, MAX_PART_SIZE)


Piece = tuple[int, int, int]  # (item number, start, end) within that item's bytes


def part_limits(max_object_size: int, preferred: int | None = None) -> tuple[int, int]:
    """``(part_size, min_part)`` for objects of at most ``max_object_size`` bytes.

    ``min_part`` is the smallest part :class:`PartCutter` closes early (at an item
    boundary); it is raised above 5 MiB only for objects so large that 10,000 parts of
    5 MiB would not hold them, which keeps every object within S3's part limit.
    """
    min_part = max(MIN_PART_SIZE, -(-max_object_size // (MAX_PARTS - 1) // MiB) * MiB)
    part_size = max(choose_part_size(min(max_object_size, MAX_OBJECT_SIZE), preferred), min_part)
    return min(part_size, MAX_PART_SIZE), min(min_part, MAX_PART_SIZE)


class PartCutter:
    """Cuts a stream of items into multipart parts, preferring cuts at item boundaries.

    S3 parts need not be equal: any size from 5 MiB up is fine except for the last. So an
    item of at least ``min_part`` bytes gets parts of its own (split evenly when larger
    than ``part_size``) and can be sent straight from its memory; only runs of small
    items, and the small tail of an item, share a part and need joining. Every part but
    the last has at least ``min_part`` bytes. Items are fed one at a time, as their sizes
    become known (compressed sizes are known only after compression).
    """

    def __init__(self, part_size: int, min_part: int = MIN_PART_SIZE, align: int = 1) -> None:
        self.part_size = part_size
        self.min_part = min_part
        self.align = align
        self._current: list[Piece] = []
        self._filled = 0
        self._emitted = False

    def add(self, item: int, length: int) -> list[list[Piece]]:
        """Feed the next item; returns the parts it completed."""
        done: list[list[Piece]] = []
        if self._current and self._filled + length <= self.part_size:
            self._current.append((item, 0, length))
            self._filled += length
            return done
        position = 0
        if self._current and self._filled < self.min_part:  # too small to close: top it up
            position = self.min_part - self._filled
            self._current.append((item, 0, position))
        if self._current:
            done.append(self._close())
        rest = length - position
        if rest < self.min_part:  # a small item or tail opens the next shared part
            self._current, self._filled = [(item, position, length)], rest
            return done
        done += [
            [(item, a, b)]
            for a, b in _even_pieces(position, length, self.part_size, self.min_part, self.align)
        ]
        self._emitted = True
        return done

    def finish(self) -> list[list[Piece]]:
        """The last part, if any. Trailing empty items hold no bytes: they never make an
        empty last part (unless every item was empty and the object is one empty PUT)."""
        if not self._current or (self._filled == 0 and self._emitted):
            self._current = []
            return []
        return [self._close()]

    def _close(self) -> list[Piece]:
        part, self._current, self._filled = self._current, [], 0
        self._emitted = True
        return part


def _even_pieces(
    start: int, end: int, part_size: int, min_part: int, align: int = 1
) -> list[tuple[int, int]]:
    """Split ``[start, end)`` into near-equal pieces of about ``part_size``, none below
    ``min_part``; with ``align``, cuts sit on multiples of ``align`` (checksum blocks, so
    that a part's CRC32C can be combined from its blocks' instead of computed again)."""
    size = end - start
    count = max(1, -(-size // part_size))
    while count > 1 and size // count < min_part:
        count -= 1
    base, extra = divmod(size, count)
    cuts, position = [], start
    for n in range(count - 1):
        position += base + (1 if n < extra else 0)
        cuts.append(position)
    if align > 1:
        cuts = _aligned(cuts, start, end, min_part, align)
    bounds = [start, *cuts, end]
    return list(itertools.pairwise(bounds))


def _aligned(cuts: list[int], start: int, end: int, min_part: int, align: int) -> list[int]:
    """``cuts`` moved to the nearest multiple of ``align``, dropping any that would leave a
    piece under ``min_part``."""
    kept, previous = [], start
    for cut in cuts:
        moved = (cut + align // 2) // align * align
        if moved - previous >= min_part and end - moved >= min_part:
            kept.append(moved)
            previous = moved
    return kept


# -- one object's requests -------------------------------------------------------------

Part = tuple[int, Body, int | None]  # (part number, body, CRC32C or None)


@dataclass(frozen=True)
class PutObject:
    """The whole object as one PutObject: it ended within one part."""

    key: str
    body: Body
    checksum: int | None


@dataclass(frozen=True)
class StartUpload:
    """CreateMultipartUpload: the object outgrew one part. Comes before its parts."""

    key: str


@dataclass(frozen=True)
class SendParts:
    """A batch of parts of the started upload, ``nbytes`` in all."""

    key: str
    parts: list[Part]
    nbytes: int


@dataclass(frozen=True)
class CompleteUpload:
    """CompleteMultipartUpload, once every batch before it is sent: the object's last request."""

    key: str
    size: int


Request = PutObject | StartUpload | SendParts | CompleteUpload


class ObjectStream:
    """One data object being written, fed item by item from the producer thread.

    Parts are held back while the object is no larger than one part: if it ends there it
    is one :class:`PutObject`; the moment it outgrows a part, :class:`StartUpload`, then
    :class:`SendParts` batches and a last :class:`CompleteUpload`.
    """

    def __init__(
        self,
        key: str,
        part_size: int,
        min_part: int,
        *,
        block_size: int,
        checksums: bool,
        batch_parts: int,
        batch_bytes: int,
    ) -> None:
        self.key = key
        self.part_size = part_size
        self.block_size = block_size
        self.cutter = PartCutter(part_size, min_part, block_size)
        self.checksums = checksums
        self.batch_parts, self.batch_limit = batch_parts, batch_bytes
        self.size = 0
        self.data: dict[int, memoryview] = {}  # items with pieces still to send
        self.crcs: dict[int, tuple[int, ...]] = {}  # their block CRC32Cs, where known
        self.count = 0
        self.held: list[tuple[Body, int | None]] = []
        self.started = False  # whether the multipart upload was asked for
        self.batch: list[Part] = []  # parts not yet handed over
        self.batch_bytes = 0
        self.sent = 0  # parts numbered so far
        self._requests: list[Request] = []  # made by the current call

    def add(
        self, data: memoryview, crcs: tuple[int, ...] | None = None
    ) -> tuple[int, list[Request]]:
        """Append an item (with its block CRC32Cs, if known): its offset in the object, and
        the requests it completed."""
        number, offset = self.count, self.size
        self.count += 1
        self.size += len(data)
        if len(data):
            self.data[number] = data
            if crcs is not None:
                self.crcs[number] = crcs
        for part in self.cutter.add(number, len(data)):
            self._emit(part)
        return offset, self._taken()

    def finish(self) -> list[Request]:
        """The object's last requests: ending with its :class:`PutObject` or :class:`CompleteUpload`."""
        for part in self.cutter.finish():
            self._emit(part)
        if not self.started:
            body = join([memoryview(b) for b, _ in self.held]) if self.held else b""
            checksum = _combined([(c, len(b)) for b, c in self.held]) if self.checksums else None
            self._requests.append(PutObject(self.key, body, checksum))
        else:
            self._hand_over()
            self._requests.append(CompleteUpload(self.key, self.size))
        return self._taken()

    def _taken(self) -> list[Request]:
        requests, self._requests = self._requests, []
        return requests

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
        body = join(pieces) if pieces else b""
        if not self.started and sum(len(b) for b, _ in self.held) + len(body) <= self.part_size:
            self.held.append((body, checksum))
            return
        if not self.started:
            self.started = True
            self._requests.append(StartUpload(self.key))
            for held, held_checksum in self.held:
                self._send(held, held_checksum)
            self.held = []
        self._send(body, checksum)

    def _crc(self, item: int, start: int, end: int) -> int:
        """CRC32C of a piece of an item: combined from its block CRCs where the piece is
        whole blocks, else computed."""
        data, blocks = self.data[item], self.crcs.get(item)
        if blocks is not None:
            crc = range_crc(blocks, self.block_size, len(data), start, end)
            if crc is not None:
                return crc
        return crc_of(data[start:end])

    def _send(self, body: Body, checksum: int | None) -> None:
        """Number a part and add it to the batch, handed over once full."""
        if self.batch and self.batch_bytes + len(body) > self.batch_limit:
            self._hand_over()
        self.sent += 1
        self.batch.append((self.sent, body, checksum))
        self.batch_bytes += len(body)
        if len(self.batch) >= self.batch_parts:
            self._hand_over()

    def _hand_over(self) -> None:
        if not self.batch:
            return
        batch, nbytes = self.batch, self.batch_bytes
        self.batch, self.batch_bytes = [], 0
        self._requests.append(SendParts(self.key, batch, nbytes))


def _combined(pieces: list[tuple[int | None, int]]) -> int:
    """The CRC32C of consecutive pieces from theirs: ``(crc, length)`` each."""
    total = 0  # the CRC32C of no bytes
    for crc, length in pieces:
        assert crc is not None
        total = combine(total, crc, length)
    return total


def join(pieces: list[memoryview]) -> Body:
    """One body from pieces: the piece itself when there is one (no copy), else a joined
    copy made without holding the GIL (:mod:`s3ckpt.transfer._gather`, or
    :func:`~s3ckpt.transfer.thread_mode.joined` where the C helper is not built)."""
    if len(pieces) == 1:
        return pieces[0]
    if _gather is not None:
        return _gather.join(pieces)
    return joined(pieces)
