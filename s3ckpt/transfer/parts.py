"""Pure functions that cut objects into multipart parts within S3's limits.

S3 (and FlashBlade) accept parts of 5 MiB to 5 GiB (the last may be smaller), at most
10,000 parts, and objects up to 5 TiB. The preferred size balances client CPU (very large
request bodies cost page faults and copies in the HTTP stack) against request count
(docs/decisions/0006-part-sizes.md).
"""

from __future__ import annotations

import itertools
import math

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
