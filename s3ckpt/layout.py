"""Planning where every item of a save lives: which object, at which offset.

A rank packs its items, in plan order, into a few large data objects rather than one
object per tensor: many small tensors cost many requests, while large objects upload as
parallel multipart parts and load as parallel ranged GETs. Object keys carry the rank and
the save id, so concurrent saves and overwrites never write to the same key.

:class:`StoredItem` is what DCP keeps per item in ``Metadata.storage_data``: enough to
fetch and verify the item (and any byte sub-range of it) without reading anything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MiB = 1024 * 1024
DEFAULT_BLOCK_SIZE = 8 * MiB
DEFAULT_MAX_OBJECT_SIZE = 64 * 1024 * MiB


@dataclass(frozen=True)
class StoredItem:
    """Where one DCP item's bytes live and how to check them.

    ``key`` is relative to the checkpoint prefix. ``crc32c`` holds one CRC32C per
    ``block_size`` block of the item's bytes (the last block may be shorter), so a
    partial read can be verified by fetching only the blocks it touches.
    """

    key: str
    offset: int
    length: int
    crc32c: tuple[int, ...]
    block_size: int = DEFAULT_BLOCK_SIZE
    codec: str = "raw"
    etag: str = ""  # of the data object, so reads can insist on the exact bytes written

    def block_span(self, start: int, end: int) -> tuple[int, int]:
        """The block-aligned ``[start, end)`` (relative to the item) covering ``[start, end)``."""
        if self.length == 0:
            return 0, 0
        first = (start // self.block_size) * self.block_size
        last = min(-(-end // self.block_size) * self.block_size, self.length)
        return first, last


@dataclass(frozen=True)
class Slot:
    """One item's place in a planned object."""

    index: object  # DCP MetadataIndex of the item
    offset: int
    length: int


@dataclass
class ObjectPlan:
    key: str
    slots: list[Slot] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.slots[-1].offset + self.slots[-1].length if self.slots else 0


def data_key(rank: int, save_id: str, number: int) -> str:
    return f"data/r{rank:05d}-{save_id}-{number:04d}.bin"


def plan_objects(
    items: list[tuple[object, int]],
    *,
    rank: int,
    save_id: str,
    max_object_size: int = DEFAULT_MAX_OBJECT_SIZE,
) -> list[ObjectPlan]:
    """Pack ``(index, nbytes)`` items, in order, into objects of at most ``max_object_size``.

    An item larger than ``max_object_size`` gets an object of its own.
    """
    objects: list[ObjectPlan] = []
    current: ObjectPlan | None = None
    for index, nbytes in items:
        if current is None or (current.slots and current.size + nbytes > max_object_size):
            current = ObjectPlan(data_key(rank, save_id, len(objects)))
            objects.append(current)
        current.slots.append(Slot(index, current.size, nbytes))
    return objects
