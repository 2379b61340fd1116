"""A load's first step: the committed manifest and DCP's metadata object it names.

Read by every rank for itself, or, given the load's process group, by its rank 0 alone and
broadcast (with its error, which every rank then raises), so the other ranks make no
request. The body is checked against the manifest's size and CRC32C (read again when
damaged, :mod:`s3ckpt.transfer.checked`) and unpickled with the restricted unpickler
(:mod:`s3ckpt.dcp.metadata_pickle`).

A metadata object that vanished after its manifest was read means a newer commit (an
overwrite, then ``gc`` of the replaced save): the newer checkpoint is read instead. Only a
manifest that still names a missing object is a damaged checkpoint.
"""

from __future__ import annotations

from crc32c import crc32c

from s3ckpt.config import S3URI
from s3ckpt.dcp import metadata_pickle as dcp_metadata
from s3ckpt.dcp.compat import Metadata, StorageMeta
from s3ckpt.dcp.process_group import SharedReads, portable
from s3ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from s3ckpt.format.manifest import Manifest
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.checked import get_intact
from s3ckpt.transfer.commit import read_manifest

OVERWRITES_FOLLOWED = 3  # newer commits a metadata read follows before giving up
Fetched = tuple[Manifest, bytes]


async def fetch_metadata(store: ObjectStore, location: S3URI) -> Fetched:
    """The committed manifest at ``location`` and the metadata object it names."""
    manifest = await committed_manifest(store, location)
    for _ in range(OVERWRITES_FOLLOWED):
        try:
            where = f"{location}/{manifest.metadata_key}"
            size, crc = manifest.metadata_size, manifest.metadata_crc32c
            return manifest, await get_intact(
                store, location.key(manifest.metadata_key), size, crc, where
            )
        except FileNotFoundError as exc:
            latest = await committed_manifest(store, location)
            if latest.save_id == manifest.save_id:
                raise CorruptCheckpointError(
                    f"{location} is committed but its metadata object is missing"
                ) from exc
            manifest = latest
    raise CorruptCheckpointError(
        f"{location} was overwritten {OVERWRITES_FOLLOWED} times while its metadata was read"
    )


async def committed_manifest(store: ObjectStore, location: S3URI) -> Manifest:
    """The manifest at ``location``; no manifest, no checkpoint (a missing bucket gets its
    own error)."""
    try:
        return await read_manifest(store, location)
    except FileNotFoundError as exc:
        await store.head_bucket()
        raise CheckpointNotFoundError(
            f"no committed checkpoint at {location} (no manifest)"
        ) from exc


def shared(outcome: Fetched | Exception | None, group: SharedReads) -> Fetched:
    """The coordinator's ``outcome`` (what it fetched, or its error; ``None`` on the other
    ranks, which make no request) on every rank: the fetched pair, or its error raised."""
    failure = outcome if isinstance(outcome, Exception) else None
    received = group.broadcast_object(portable(failure) if failure is not None else outcome)
    if failure is not None:
        raise failure
    if isinstance(received, BaseException):
        raise received
    return received


def unpickled(location: S3URI, manifest: Manifest, body: bytes, *, trust_pickles: bool) -> Metadata:
    """DCP's metadata from the body of ``manifest``'s metadata object, checked again (it may
    have travelled through a broadcast), its ``load_id`` the save it belongs to."""
    where = f"{location}/{manifest.metadata_key}"
    if len(body) != manifest.metadata_size:
        raise CorruptCheckpointError(
            f"{where} has {len(body)} bytes, the manifest says {manifest.metadata_size}"
        )
    if crc32c(body) != manifest.metadata_crc32c:
        raise CorruptCheckpointError(f"checksum mismatch in {where}")
    metadata = dcp_metadata.loads(body, where, trust_pickles=trust_pickles)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = manifest.save_id
    return metadata
