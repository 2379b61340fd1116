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
