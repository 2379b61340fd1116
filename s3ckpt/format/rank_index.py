"""Per-rank index objects: where each item of one rank lives, written by that rank.

Format 1 listed every item of every rank in the manifest and again in DCP's pickled
metadata: a commit record of O(items x ranks) (about 0.6 KB per item and rank), built by
one coordinator and read whole by every rank on load. At a thousand ranks with thousands
of items each that is gigabytes before the first tensor byte.

Format 2 splits it by rank. During ``write_data`` every rank writes its own
:class:`RankIndex` (the items it stored: object, offset, length, checksums, codec) to
``index/[<hex>/]r<rank>-<save>.json``, in parallel with all other ranks. The manifest lists
only objects and these index objects (:class:`~s3ckpt.format.manifest.IndexRef`, with
size and CRC32C), so it grows with ranks, not items. DCP's metadata keeps what DCP's
planner needs plus :class:`ItemOwners` (which rank stored each chunk: four bytes per
chunk), so a loading rank fetches only the index objects of the ranks whose data it reads.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from s3ckpt.errors import CorruptCheckpointError
from s3ckpt.format.manifest import ItemEntry

INDEX_FORMAT = "s3ckpt-index"
_RANK = struct.Struct("<I")
NO_RANK = 0xFFFFFFFF  # a chunk position no rank reported (never in a valid checkpoint)


@dataclass(frozen=True)
class RankIndex:
    """The items one rank stored in one save."""

    save_id: str
    rank: int
    items: tuple[ItemEntry, ...]

    def to_json(self) -> bytes:
        body = {
            "format": INDEX_FORMAT,
            "save_id": self.save_id,
            "rank": self.rank,
            "items": [item.to_dict() for item in self.items],
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str, etags: dict[str, str]) -> RankIndex:
        """Parse an index object; ``etags`` (from the manifest's object list) complete the
        items' stored records. Unknown fields are ignored."""
        try:
            raw: dict[str, Any] = json.loads(data)
            if raw.get("format") != INDEX_FORMAT:
                raise ValueError("not an s3ckpt index object")
            return cls(
                save_id=str(raw["save_id"]),
                rank=int(raw["rank"]),
                items=tuple(ItemEntry.from_dict(i, etags) for i in raw["items"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(f"unreadable index object {where}: {exc}") from exc

    def by_index(self) -> dict[tuple[str, tuple[int, ...]], ItemEntry]:
        """Items by ``(fqn, chunk offsets)``, the identity DCP gives a stored chunk."""
        return {(item.fqn, tuple(item.chunk_offsets)): item for item in self.items}


@dataclass(frozen=True)
class ItemOwners:
    """Which rank stored each chunk: DCP's ``Metadata.storage_data`` in format 2.

    ``ranks`` maps an FQN to one little-endian uint32 per chunk, in the order of the
    chunks in DCP's ``TensorStorageMetadata.chunks`` (one entry for a non-tensor item).
    Pickled into DCP's metadata, so its import path is part of the format.
    """

    ranks: dict[str, bytes]

    def rank_of(self, fqn: str, position: int) -> int:
        """The rank that stored chunk ``position`` of ``fqn``."""
        table = self.ranks.get(fqn)
        if table is None or not 0 <= position < len(table) // _RANK.size:
            raise KeyError((fqn, position))
        (rank,) = _RANK.unpack_from(table, position * _RANK.size)
        if rank == NO_RANK:
            raise KeyError((fqn, position))
        return int(rank)

    @classmethod
    def build(cls, chunks: dict[str, int], owned: list[tuple[str, int, int]]) -> ItemOwners:
        """From the number of chunks per FQN and ``(fqn, position, rank)`` per stored item."""
        tables = {fqn: bytearray(b"\xff" * (_RANK.size * count)) for fqn, count in chunks.items()}
        for fqn, position, rank in owned:
            _RANK.pack_into(tables[fqn], position * _RANK.size, rank)
        return cls({fqn: bytes(table) for fqn, table in tables.items()})
