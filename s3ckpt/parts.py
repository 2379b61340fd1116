"""Pure functions that cut objects into multipart parts within S3's limits.

S3 (and FlashBlade) accept parts of 5 MiB to 5 GiB (the last may be smaller), at most
10,000 parts, and objects up to 5 TiB. The preferred size balances client CPU (very large
request bodies cost page faults and copies in the HTTP stack) against request count.
"""

from __future__ import annotations

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


def is_multipart(object_size: int, part_size: int) -> bool:
    """Objects larger than one part go multipart; smaller ones are a single PUT."""
    return object_size > part_size


def part_ranges(object_size: int, part_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` byte ranges of each part, in part-number order."""
    if object_size == 0:
        return [(0, 0)]
    return [
        (start, min(start + part_size, object_size)) for start in range(0, object_size, part_size)
    ]


Piece = tuple[int, int, int]  # (item number, start, end) within that item's bytes


def cut_parts(lengths: list[int], part_size: int, min_part: int = MIN_PART_SIZE) -> list[list[Piece]]:
    """Cut a sequence of items into multipart parts, preferring cuts at item boundaries.

    S3 parts need not be equal: any size from 5 MiB up is fine except for the last. So an
    item of at least ``min_part`` bytes gets parts of its own (split evenly when larger
    than ``part_size``) and is sent straight from its memory; only runs of small items, and
    the small tail of an item, share a part and need joining. If that would exceed 10,000
    parts, fixed-size parts are used instead.
    """
    parts: list[list[Piece]] = []
    current: list[Piece] = []
    filled = 0
    for item, length in enumerate(lengths):
        if current and filled + length <= part_size:
            current.append((item, 0, length))
            filled += length
            continue
        position = 0
        if current and filled < min_part:  # too small to close: top it up from this item
            position = min_part - filled
            current.append((item, 0, position))
        if current:
            parts.append(current)
            current, filled = [], 0
        rest = length - position
        if rest < min_part:  # a small item or tail opens the next shared part
            current, filled = [(item, position, length)], rest
            continue
        parts += [[(item, a, b)] for a, b in _even_pieces(position, length, part_size, min_part)]
    if current and filled == 0 and parts:
        parts[-1] += current  # trailing empty items ride along; never send an empty last part
    elif current:
        parts.append(current)
    if len(parts) > MAX_PARTS:
        return _fixed_parts(lengths, part_size)
    return parts or [[]]


def _even_pieces(start: int, end: int, part_size: int, min_part: int) -> list[tuple[int, int]]:
    """Split ``[start, end)`` into near-equal pieces of at most ~part_size, none below min_part."""
    size = end - start
    count = max(1, -(-size // part_size))
    while count > 1 and size // count < min_part:
        count -= 1
    base, extra = divmod(size, count)
    pieces, position = [], start
    for n in range(count):
        step = base + (1 if n < extra else 0)
        pieces.append((position, position + step))
        position += step
    return pieces


def _fixed_parts(lengths: list[int], part_size: int) -> list[list[Piece]]:
    parts: list[list[Piece]] = []
    current: list[Piece] = []
    filled = 0
    for item, length in enumerate(lengths):
        position = 0
        while position < length:
            take = min(part_size - filled, length - position)
            current.append((item, position, position + take))
            filled += take
            position += take
            if filled == part_size:
                parts.append(current)
                current, filled = [], 0
    if current:
        parts.append(current)
    return parts or [[]]
