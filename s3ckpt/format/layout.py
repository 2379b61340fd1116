"""Where an item's bytes live in the store: data object keys and the per-item record.

A rank's items go back to back into a few large data objects (the packing is done by
:class:`s3ckpt.transfer.upload.RankUploader` as items stream in, since a compressed item's
size is known only once it is compressed). :func:`data_key` names those objects: the
rank and the save id are in every key, so concurrent saves and overwrites never write to
the same key.

:class:`StoredItem` is the per-item record each rank's index object lists
(:mod:`s3ckpt.format.rank_index`): enough to fetch and verify the item, and any byte
sub-range of it, without reading anything else. Format 1 kept it per item in DCP's
``Metadata.storage_data`` (pickled, so its import path is part of the format: see
:mod:`s3ckpt.dcp.metadata_pickle`) and in the manifest.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

MiB = 1024 * 1024
DEFAULT_BLOCK_SIZE = 8 * MiB
DEFAULT_MAX_OBJECT_SIZE = 64 * 1024 * MiB


@dataclass(frozen=True)
class StoredItem:
    """Where one DCP item's bytes live and how to check them.

    ``key`` is relative to the checkpoint prefix; ``offset``/``length`` locate the stored
    bytes there. ``crc32c`` holds one CRC32C per ``block_size`` block of the item's raw
    bytes (the last block may be shorter), so a partial read can be verified by fetching
    only the blocks it touches. For a compressed item (``codec`` other than ``raw``),
    ``raw_length`` is the decoded size and ``frames`` the stored size of each block's frame.
    """

    key: str
    offset: int
    length: int
    crc32c: tuple[int, ...]
    block_size: int = DEFAULT_BLOCK_SIZE
    codec: str = "raw"
    etag: str = ""  # of the data object (from the manifest's object list; not in index JSON)
    raw_length: int | None = None
    frames: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        """The item's raw (decoded) size."""
        return self.length if self.raw_length is None else self.raw_length

    def block_span(self, start: int, end: int) -> tuple[int, int]:
        """The block-aligned raw ``[start, end)`` covering raw ``[start, end)``."""
        if self.size == 0:
            return 0, 0
        first = (start // self.block_size) * self.block_size
        last = min(-(-end // self.block_size) * self.block_size, self.size)
        return first, last

    def stored_span(self, first: int, last: int) -> tuple[int, int]:
        """Stored bytes (relative to the item) holding the raw block-aligned ``[first, last)``."""
        return stored_span(self.frames, self.block_size, first, last)


def stored_span(frames: tuple[int, ...], block_size: int, first: int, last: int) -> tuple[int, int]:
    """For an item stored as ``frames`` (one per raw block; none if raw), the stored bytes
    holding its raw block-aligned range ``[first, last)``."""
    if not frames:
        return first, last
    start_block, end_block = first // block_size, -(-last // block_size)
    return sum(frames[:start_block]), sum(frames[:end_block])


SPREAD_WIDTHS = {0: 0, 16: 1, 256: 2, 4096: 3}  # prefixes -> hex digits naming one


def data_key(rank: int, save_id: str, number: int, spread: int = 0) -> str:
    """``data/r<rank>-<save>-<n>.bin``; with ``spread`` (16, 256 or 4096), under one of that
    many hashed prefixes, ``data/<hex>/r...``, for stores that partition request rates by
    key prefix (AWS S3: about 3,500 PUTs per second per prefix)."""
    return _spread("data", f"r{rank:05d}-{save_id}-{number:04d}.bin", f"{rank}/{number}", spread)


def is_rank_data(key: str, rank: int) -> bool:
    """Whether ``key`` is one of rank ``rank``'s data objects (of any save, spread or not)."""
    folder, _, name = key.rpartition("/")
    return name.startswith(f"r{rank:05d}-") and name.endswith(".bin") and "data" in folder


def index_key(rank: int, save_id: str, spread: int = 0) -> str:
    """``index/r<rank>-<save>.json``: the rank's item table (:mod:`s3ckpt.format.rank_index`);
    spread like the data objects, since every rank writes one at the same moment."""
    return _spread("index", f"r{rank:05d}-{save_id}.json", f"{rank}/index", spread)


def _spread(folder: str, name: str, seed: str, spread: int) -> str:
    width = SPREAD_WIDTHS[spread]
    if not width:
        return f"{folder}/{name}"
    digest = hashlib.blake2b(seed.encode(), digest_size=4).hexdigest()
    return f"{folder}/{digest[:width]}/{name}"


def metadata_key(save_id: str) -> str:
    """DCP's pickled metadata of one save."""
    return f"metadata-{save_id}.pkl"


SAVING_PREFIX = ".s3ckpt-saving-"
# Writers refresh an in-flight record every HEARTBEAT_S; readers of the listing (gc, prune,
# ls) take one refreshed within LEASE_S for a save still running. Both sides of the
# contract live here because writers and gc may be different releases.
HEARTBEAT_S = 60.0
LEASE_S = 5 * HEARTBEAT_S
CLAIM_PREFIX = ".s3ckpt-claim-"


def saving_key(save_id: str) -> str:
    """The in-flight record of a save: written before its first object, refreshed while it
    runs, deleted after its commit (:mod:`s3ckpt.transfer.inflight`)."""
    return f"{SAVING_PREFIX}{save_id}"


def claim_key(save_id: str) -> str:
    """A save's claim on the commit, on stores without conditional writes
    (:mod:`s3ckpt.transfer.commit`)."""
    return f"{CLAIM_PREFIX}{save_id}"
