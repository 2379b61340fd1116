"""Writing and reading the per-rank index objects of format 2 (:mod:`s3ckpt.format.rank_index`).

Each rank PUTs its own index while it saves; the manifest records every index's size and
CRC32C, so a reader checks an index before trusting one offset in it. A damaged index is
a damaged checkpoint (:class:`~s3ckpt.errors.CorruptCheckpointError`). A missing one
raises ``FileNotFoundError`` from :func:`read_index`: a load first checks whether the
checkpoint was overwritten meanwhile; :func:`with_items` reports it as damage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from crc32c import crc32c

from s3ckpt.config import S3URI
from s3ckpt.errors import CorruptCheckpointError, StorageError
from s3ckpt.format.manifest import IndexRef, Manifest
from s3ckpt.format.rank_index import RankIndex
from s3ckpt.s3.loop import bounded
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.checked import Rereads, intact
from s3ckpt.transfer.collector import collector_paused

PARALLEL_INDEX_READS = 32


def index_body(index: RankIndex) -> bytes:
    """``index`` as its object's JSON, encoded with the collector paused (a dict per item,
    dropped once encoded: :func:`~s3ckpt.transfer.collector.collector_paused`)."""
    with collector_paused():
        return index.to_json()


async def write_index(store: ObjectStore, location: S3URI, key: str, index: RankIndex) -> IndexRef:
    """PUT one rank's index at ``key`` (relative to ``location``); what the manifest lists."""
    body = index_body(index)
    checksum = crc32c(body)
    await store.put(location.key(key), body, crc32c=checksum, content_type="application/json")
    return IndexRef(index.rank, key, len(body), checksum, len(index.items))


async def read_index(
    store: ObjectStore, location: S3URI, ref: IndexRef, etags: dict[str, str]
) -> RankIndex:
    """GET and check one rank's index object (``FileNotFoundError`` if it is gone); a body
    that fails its check is read again (:mod:`s3ckpt.transfer.checked`)."""
    where = f"{location}/{ref.key}"
    tries = Rereads()
    while True:
        body = await store.get(location.key(ref.key))
        try:
            return RankIndex.from_json(intact(body, ref.size, ref.crc32c, where), where, etags)
        except CorruptCheckpointError as exc:
            tries.reread_or_raise(exc)


async def read_indexes(
    store: ObjectStore, location: S3URI, manifest: Manifest, ranks: Iterable[int]
) -> dict[int, RankIndex]:
    """The index objects of ``ranks``, read in parallel (at most :data:`PARALLEL_INDEX_READS`
    at a time); the first that cannot be read stops the others and is raised."""
    refs = {ref.rank: ref for ref in manifest.indexes}
    wanted = sorted(set(ranks))
    missing = [rank for rank in wanted if rank not in refs]
    if missing:
        raise CorruptCheckpointError(
            f"{location} has no index object for rank(s) {missing[:5]} in its manifest"
        )
    etags = manifest.etags()
    indexes = await bounded(
        [lambda r=refs[rank]: read_index(store, location, r, etags) for rank in wanted],
        PARALLEL_INDEX_READS,
    )
    return dict(zip(wanted, indexes, strict=True))


async def read_each(
    store: ObjectStore, location: S3URI, manifest: Manifest, refs: list[IndexRef]
) -> list[RankIndex | CorruptCheckpointError | StorageError]:
    """Every index object of ``refs``, or why it could not be read, in order; at most
    :data:`PARALLEL_INDEX_READS` at a time (``verify`` reports every damaged index)."""
    etags = manifest.etags()

    async def one(ref: IndexRef) -> RankIndex | CorruptCheckpointError | StorageError:
        try:
            return await read_index(store, location, ref, etags)
        except (CorruptCheckpointError, StorageError) as exc:
            return exc

    return await bounded([lambda r=ref: one(r) for ref in refs], PARALLEL_INDEX_READS)


async def with_items(store: ObjectStore, location: S3URI, manifest: Manifest) -> Manifest:
    """``manifest`` with :attr:`~Manifest.items` complete: as is for format 1; for format 2
    with every rank's index object read (for ``show`` and ``verify``, which need them all)."""
    if manifest.items_listed:
        return manifest
    try:
        indexes = await read_indexes(store, location, manifest, (r.rank for r in manifest.indexes))
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(
            f"{location} is committed but an index object is missing: {exc}"
        ) from exc
    items = tuple(item for rank in sorted(indexes) for item in indexes[rank].items)
    return dataclasses.replace(manifest, items=items)
