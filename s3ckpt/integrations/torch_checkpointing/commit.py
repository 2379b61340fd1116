"""The commit of a torch-checkpointing save on S3, and a committed checkpoint read back.

Each rank's index object is written before torch-checkpointing's barrier; after it, rank 0
finds exactly one index per rank of this save (a rank deletes those its own earlier,
failed attempts left before writing its new one, so an index from before cannot be taken
for this save's), checks every data object with one listing, then writes the metadata
object and the manifest, last, with :func:`~s3ckpt.transfer.commit.commit_manifest`. The
metadata is DCP's (:mod:`s3ckpt.dcp.file_items`).
"""

from __future__ import annotations

import asyncio
import re

from crc32c import crc32c

from s3ckpt.catalog.api import acommitted_names, aremove_checkpoint
from s3ckpt.config import S3URI
from s3ckpt.dcp import metadata_pickle, metadata_read
from s3ckpt.dcp.compat import TORCH_VERSION
from s3ckpt.dcp.file_items import file_owners, files_metadata
from s3ckpt.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    ConfigError,
    IncompleteSaveError,
)
from s3ckpt.format.layout import StoredItem, index_key
from s3ckpt.format.manifest import IndexRef, ItemEntry, Manifest, ObjectEntry
from s3ckpt.format.rank_index import RankIndex
from s3ckpt.integrations.torch_checkpointing.files import Committed, Saving
from s3ckpt.s3.loop import bounded
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.commit import commit_manifest, read_manifest
from s3ckpt.transfer.inflight import clear_in_flight
from s3ckpt.transfer.object_writer import WrittenObject
from s3ckpt.transfer.rank_index import index_body

PARALLEL_READS = 32
_INDEX = re.compile(r"^index/r(?P<rank>\d+)-(?P<save>[0-9a-f]+)\.json$")


async def write_index(store: ObjectStore, saving: Saving) -> None:
    """This rank's index object (each file it wrote: its object and checksums), after
    deleting the ones its earlier attempts at this checkpoint left."""
    location, rank = saving.location, saving.rank
    own = index_key(rank, saving.save_id)
    mine = own.rsplit("-", 1)[0] + "-"  # "index/r<rank>-": this rank's indexes alone
    stale = [key for key, _ in await _indexes(store, location, mine) if key != own]
    if stale:
        await store.delete_many([location.key(key) for key in stale])
    prefix = len(location.key(""))
    items = tuple(
        ItemEntry(name, (), "bytes", None, None, _stored(written, prefix))
        for name, written in sorted(saving.items().items())
    )
    body = index_body(RankIndex(saving.save_id, rank, items))
    await store.put(location.key(own), body, crc32c=crc32c(body), content_type="application/json")


def _stored(written: WrittenObject, prefix: int) -> StoredItem:
    return StoredItem(
        key=written.key[prefix:],
        offset=0,
        length=written.size,
        crc32c=written.block_crcs,
        block_size=written.block_size,
    )


async def commit(store: ObjectStore, saving: Saving, world_size: int) -> None:
    """On rank 0, once every rank's index is written: check, then commit (see the module)."""
    location = saving.location
    found = await _indexes(store, location)
    by_rank: dict[int, list[tuple[str, int]]] = {}
    for key, size in found:
        by_rank.setdefault(_rank(key), []).append((key, size))
    missing = [rank for rank in range(world_size) if rank not in by_rank]
    if missing:
        raise IncompleteSaveError(f"{location}: no index object from rank(s) {missing[:8]}")
    doubled = [rank for rank, keys in by_rank.items() if len(keys) > 1]
    if doubled or max(by_rank) >= world_size:
        raise CommitConflictError(
            f"{location}: index objects of other saves are there too (ranks "
            f"{sorted(doubled or [max(by_rank)])[:8]}): was it saved twice at once?"
        )
    bodies = await bounded(
        [lambda k=by_rank[r][0][0]: store.get(location.key(k)) for r in range(world_size)],
        PARALLEL_READS,
    )
    indexes = [
        RankIndex.from_json(body, f"{location}/{by_rank[rank][0][0]}", {})
        for rank, body in enumerate(bodies)
    ]
    objects = await _objects(store, location, indexes)
    metadata = files_metadata(_owners(location, indexes))
    body = metadata_pickle.dumps(metadata)
    manifest = Manifest.of_save(
        saving.save_id,
        world_size,
        body,
        objects=objects,
        indexes=tuple(
            IndexRef(rank, by_rank[rank][0][0], len(raw), crc32c(raw), len(index.items))
            for rank, (raw, index) in enumerate(zip(bodies, indexes, strict=True))
        ),
        torch_version=TORCH_VERSION,
    )
    await store.put(location.key(manifest.metadata_key), body, crc32c=manifest.metadata_crc32c)
    await commit_manifest(store, location, manifest, overwrite=False)
    await asyncio.gather(*(clear_in_flight(store, location, i.save_id) for i in indexes))


async def read_committed(store: ObjectStore, location: S3URI) -> Committed:
    """The committed checkpoint at ``location``: its manifest and DCP metadata checked,
    which must describe files (``CheckpointNotFoundError`` if nothing is committed)."""
    try:
        manifest = await read_manifest(store, location)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"no committed checkpoint at {location}") from exc
    body = await store.get(location.key(manifest.metadata_key))
    metadata = metadata_read.unpickled(location, manifest, body, trust_pickles=False)
    owners = file_owners(metadata)
    if owners is None:
        raise ConfigError(
            f"{location} holds tensors saved through DCP, not torch-checkpointing files: "
            "load it with dcp.load and an S3StorageReader"
        )
    return Committed(location, manifest, owners, tuple(metadata.state_dict_metadata))


async def committed_names(store: ObjectStore, run: S3URI) -> list[str]:
    """The committed checkpoints directly under ``run``."""
    return [name for name in await acommitted_names(store, run) if name and "/" not in name]


async def remove(store: ObjectStore, location: S3URI) -> None:
    """Remove the committed checkpoint at ``location`` (manifest first)."""
    await aremove_checkpoint(store, location)


async def _indexes(
    store: ObjectStore, location: S3URI, under: str = "index/"
) -> list[tuple[str, int]]:
    """The index objects under ``location`` whose keys start with ``under``: key
    (relative) and size."""
    prefix = location.key("")
    return [
        (meta.key[len(prefix) :], meta.size)
        async for meta in store.list(location.key(under))
        if _INDEX.match(meta.key[len(prefix) :])
    ]


def _rank(key: str) -> int:
    match = _INDEX.match(key)
    assert match is not None
    return int(match["rank"])


async def _objects(
    store: ObjectStore, location: S3URI, indexes: list[RankIndex]
) -> tuple[ObjectEntry, ...]:
    """Every data object the indexes name, as one listing finds it (size checked)."""
    prefix = location.key("")
    listed = {meta.key[len(prefix) :]: meta async for meta in store.list(location.key("data/"))}
    entries = []
    for index in indexes:
        for item in index.items:
            meta = listed.get(item.stored.key)
            if meta is None or meta.size != item.stored.length:
                raise IncompleteSaveError(
                    f"{location}/{item.stored.key} (file {item.fqn!r} of rank {index.rank}) "
                    f"is {'missing' if meta is None else f'{meta.size} bytes, not {item.stored.length}'}"
                )
            entries.append(ObjectEntry(item.stored.key, meta.size, meta.etag, index.rank))
    return tuple(entries)


def _owners(location: S3URI, indexes: list[RankIndex]) -> dict[str, int]:
    """Each file, and the rank that wrote it (two ranks writing one name is refused)."""
    owned: dict[str, int] = {}
    for index in indexes:
        for item in index.items:
            if item.fqn in owned:
                raise ConfigError(
                    f"{location}: ranks {owned[item.fqn]} and {index.rank} both wrote {item.fqn!r}"
                )
            owned[item.fqn] = index.rank
    return owned
