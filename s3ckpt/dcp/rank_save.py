"""One rank's ``write_data``: its items streamed into data objects, then its index object.

Items are resolved as the uploader asks for them, a run of a few MiB at a time (a GPU
tensor is copied to the host only when its run comes), exposed zero-copy or compressed
(:mod:`s3ckpt.format.compression`), and added one by one to :class:`~s3ckpt.transfer.upload.
RankUploader`, which packs them into a few data objects (each named here, by the layout,
when the uploader says an item starts one) and returns where each went; then the rank's
index object
(:mod:`s3ckpt.format.rank_index`) records, per item, where it went and its block CRC32Cs.
What the rank tells the coordinator is one :class:`RankRecord` shared by all its results.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from s3ckpt.config import S3URI
from s3ckpt.dcp.compat import SavePlanner, WriteItem, WriteItemType, WriteResult, item_nbytes
from s3ckpt.dcp.save_identity import RankAssignment
from s3ckpt.dcp.tensor_bytes import as_cpu_contiguous, tensor_view
from s3ckpt.errors import ConfigError, S3CkptError
from s3ckpt.format.compression import RAW, Compression, Compressor, Encoded, RawRuns
from s3ckpt.format.layout import StoredItem, data_key, index_key
from s3ckpt.format.manifest import IndexRef, ItemEntry, ObjectEntry
from s3ckpt.format.rank_index import RankIndex
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.parts import MAX_OBJECT_SIZE
from s3ckpt.transfer.rank_index import write_index
from s3ckpt.transfer.upload import Placement, RankUploader

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankTarget:
    """Where and how a rank's items are stored: what the writer hands its rank's save."""

    store: ObjectStore
    location: S3URI
    spread_prefixes: int
    max_object_size: int
    compression: Compression | None


class RankSave:
    """One rank's ``write_data``: stream items (compressed if asked) into the uploader,
    then describe where each went."""

    def __init__(self, target: RankTarget, assignment: RankAssignment) -> None:
        self.target = target
        self.assignment = assignment

    def run(self, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        sizes = [planned_size(item) for item in items]
        _refuse_oversized(items, sizes)
        if not items:  # nothing stored, no index: the manifest lists ranks that stored items
            return []
        target, rank, save_id = self.target, self.assignment.rank, self.assignment.save_id
        store, location, spread = target.store, target.location, target.spread_prefixes
        uploader = RankUploader(
            store,
            max_object_size=target.max_object_size,
            size_hint=sum(size for size in sizes if size) + (64 << 20),
            in_flight=target.compression.max_ahead if target.compression else None,
        )
        # Per item, by its position in the plan: how it was stored, its bytes left out.
        # By position, not by DCP's MetadataIndex: hashing that dataclass costs
        # microseconds, paid several times per item on a thread that shares the GIL with
        # the training loop in thread mode.
        encodings: list[Encoded] = []
        keys: list[str] = []  # of the data objects, by number
        entries: list[ItemEntry] = []
        try:
            for position, data, crcs in self._stream(items, sizes, planner, encodings):
                where = uploader.add(data, crcs)
                if where is None:  # the item starts the next data object, named here
                    keys.append(data_key(rank, save_id, len(keys), spread))
                    uploader.open(location.key(keys[-1]), len(data))
                    where = uploader.add(data, crcs)
                    assert where is not None  # an empty object takes any item
                # The item's index entry, built as soon as it has its place: a few
                # microseconds an item while the upload goes on, not one hold of
                # milliseconds at its end, which a training loop beside a thread-mode save
                # would wait out.
                entries.append(_entry(items[position], encodings[position], where, keys))
            uploaded = uploader.finish()
        except BaseException as exc:
            raise uploader.abandon(exc) from None
        if len(entries) != len(items):
            raise AssertionError(f"{len(entries)} index entries for {len(items)} items")
        objects = tuple(ObjectEntry(keys[n], o.size, o.etag, rank) for n, o in enumerate(uploaded))
        index = RankIndex(save_id, rank, tuple(entries))
        key = index_key(rank, save_id, spread)
        try:
            ref = io_loop().run(write_index(store, location, key, index))
        except BaseException:
            io_loop().run(_delete_quietly(store, [o.key for o in uploaded]))
            raise
        # One record per rank, shared by all its results: pickled once when DCP gathers
        # them, so the coordinator receives O(ranks) storage data, not O(items).
        record = RankRecord(rank, ref, objects, save_id)
        return [
            WriteResult(item.index, encoded.raw_length, record)
            for item, encoded in zip(items, encodings, strict=True)
        ]

    def _stream(
        self,
        items: list[WriteItem],
        sizes: list[int | None],
        planner: SavePlanner,
        encodings: list[Encoded],
    ) -> Iterator[tuple[int, memoryview, tuple[int, ...] | None]]:
        """``(position, stored bytes, their block CRC32Cs)`` in plan order, each item
        resolved only when its turn comes: raw items checksummed a run at a time
        (:class:`~s3ckpt.format.compression.RawRuns`), compressed ones in worker threads
        within ``max_ahead`` (:class:`~s3ckpt.format.compression.Compressor`; the CRCs
        are of raw bytes, so compressed items go without); each item's encoding, its bytes
        left out, is appended to ``encodings``."""
        resolved = (
            (position, _item_bytes(item, size, planner), item)
            for position, (item, size) in enumerate(zip(items, sizes, strict=True))
        )
        options = self.target.compression
        if options is None:
            runs: RawRuns[int] = RawRuns()
            for position, data, _ in resolved:
                if runs.add(position, data):
                    yield from (_kept(done, encodings) for done in runs.take())
            yield from (_kept(done, encodings) for done in runs.take())
            return
        with Compressor[int](options) as compressor:
            for position, data, item in resolved:
                while compressor.full(len(data)):
                    yield _kept(compressor.take(), encodings)
                compressor.submit(position, data, _grouping(item))
            while compressor.pending:
                yield _kept(compressor.take(), encodings)


def _kept(
    done: tuple[int, Encoded], encodings: list[Encoded]
) -> tuple[int, memoryview, tuple[int, ...] | None]:
    """What the uploader gets of an encoded item, its encoding kept in ``encodings`` for
    the storage record without its bytes: the uploader holds the payload only until its
    parts are sent (bounded by max_bytes_in_flight), so a compressed save never holds the
    rank's whole compressed state."""
    position, result = done
    encodings.append(
        Encoded(_NO_BYTES, result.codec, result.raw_length, result.crc32c, result.frames)
    )
    return position, result.payload, result.crc32c if result.codec == RAW else None


_NO_BYTES = memoryview(b"")


def _entry(item: WriteItem, encoded: Encoded, placed: Placement, keys: list[str]) -> ItemEntry:
    """The item's line in the rank's index: where it went and how to check it. The data
    object's ETag is not in the index (its JSON leaves it out; a reader takes it from the
    manifest's object list), so an entry is complete before its object is."""
    stored = StoredItem(
        key=keys[placed.object],
        offset=placed.offset,
        length=placed.length,
        crc32c=encoded.crc32c,
        codec=encoded.codec,
        raw_length=None if encoded.codec == RAW else encoded.raw_length,
        frames=encoded.frames,
    )
    tensor = item.tensor_data if item.type != WriteItemType.BYTE_IO else None
    return ItemEntry(
        fqn=item.index.fqn,
        chunk_offsets=tuple(item.index.offset or ()),
        kind="tensor" if tensor is not None else "bytes",
        dtype=_dtype_name(tensor.properties.dtype) if tensor else None,
        shape=tuple(tensor.chunk.sizes) if tensor else None,
        stored=stored,
    )


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: the index's spelling."""
    return str(dtype).removeprefix("torch.")


def rank_name(rank: int | None) -> str:
    return "?" if rank is None else str(rank)


def _refuse_oversized(items: list[WriteItem], sizes: list[int | None]) -> None:
    """Before any byte is sent: an item gets at most one object, and S3 objects stop at 5 TiB."""
    for item, size in zip(items, sizes, strict=True):
        if size is not None and size > MAX_OBJECT_SIZE:
            raise ConfigError(
                f"{item.index.fqn} is {size} bytes: S3 objects are limited to "
                "5 TiB; shard the tensor (DTensor) so that no shard is larger"
            )


def planned_size(item: WriteItem) -> int | None:
    """The bytes a tensor item will occupy (:func:`item_nbytes`); None for a bytes item,
    whose size is known only once it is resolved."""
    return None if item.type == WriteItemType.BYTE_IO else item_nbytes(item)


def _item_bytes(item: WriteItem, planned: int | None, planner: SavePlanner) -> memoryview:
    """The bytes of ``item`` as ``planner`` resolves it; a tensor's must be the ``planned``
    size (:func:`planned_size`, worked out once per item by the caller)."""
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        return data.getbuffer()
    if not isinstance(data, torch.Tensor):
        raise TypeError(
            f"planner resolved {item.index.fqn} to {type(data).__name__}, expected a tensor"
        )
    if data.layout != torch.strided:
        raise ConfigError(
            f"{item.index.fqn}: {data.layout} tensors are not supported; save tensor.to_dense()"
        )
    view = tensor_view(as_cpu_contiguous(data))
    if len(view) != planned:
        raise ValueError(f"item {item.index.fqn} resolved to {len(view)} bytes, planned {planned}")
    return view


def _grouping(item: WriteItem) -> int:
    """Element size to byte-group by: floating-point tensors only."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    dtype = item.tensor_data.properties.dtype
    return dtype.itemsize if dtype.is_floating_point and dtype.itemsize in (2, 4, 8) else 0


async def _delete_quietly(store: ObjectStore, keys: list[str]) -> None:
    """Best effort: a rank that cannot finish removes what it uploaded (gc would, later)."""
    try:
        await store.delete_many(keys)
    except S3CkptError as exc:
        log.warning("could not delete %d object(s) of a failed rank: %s", len(keys), exc)


@dataclass(frozen=True)
class RankRecord:
    """What a rank's ``write_data`` tells the coordinator: its index and data objects."""

    rank: int
    index: IndexRef
    objects: tuple[ObjectEntry, ...]
    save_id: str = ""  # the id its keys carry: the coordinator's, or a replay's own
