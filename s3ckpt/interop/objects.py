"""Copying one object between two stores: server-side where it can, streamed where not.

On one endpoint (the same S3 configuration on both sides) the bytes never leave the server:
``CopyObject`` up to :data:`COPY_OBJECT_LIMIT` (S3's 5 GiB), ``UploadPartCopy`` parts above
it. Between endpoints the object is streamed: read in parts by ranged GETs and written by
``UploadPart`` (or one ``PutObject`` when it fits in one part), each part sent with its
CRC32C so the destination rejects bytes damaged on the way. At most one part per copy is
in memory. No torch here: ``s3ckpt cp`` runs without it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from crc32c import crc32c

from s3ckpt.errors import StorageError
from s3ckpt.s3.store import ObjectStore, PartResult
from s3ckpt.transfer.parts import GiB, MiB, choose_part_size

COPY_OBJECT_LIMIT = 5 * GiB  # the largest object CopyObject accepts
STREAM_PART_SIZE = 64 * MiB  # parts of streamed copies (memory per copy in flight)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoints:
    """The two sides of a copy; ``server_side`` when one endpoint serves both."""

    source: ObjectStore
    destination: ObjectStore
    copy_object_limit: int = COPY_OBJECT_LIMIT
    part_size: int = STREAM_PART_SIZE

    @property
    def server_side(self) -> bool:
        return self.source.config.client_key() == self.destination.config.client_key()


async def copy_object(sides: Endpoints, source_key: str, key: str, size: int) -> str:
    """Copy ``source_key`` (``size`` bytes) to ``key``; the new object's ETag."""
    if sides.server_side and size <= sides.copy_object_limit:
        return await sides.destination.copy(key, sides.source.bucket, source_key)
    if not sides.server_side and size <= sides.part_size:
        body = await _read(sides.source, source_key, 0, size)
        return await sides.destination.put(key, body, crc32c=crc32c(body))
    return await _multipart(sides, source_key, key, size)


async def _read(store: ObjectStore, key: str, start: int, end: int) -> memoryview:
    data = memoryview(bytearray(end - start))
    if end > start:
        await store.read_range(key, start, end, data)
    return data


async def _multipart(sides: Endpoints, source_key: str, key: str, size: int) -> str:
    """A multipart copy, part by part; aborted if any part fails."""
    destination = sides.destination
    if sides.server_side:  # copied parts carry no client-computed checksum to declare
        destination = ObjectStore(destination.config.replace(checksums=False), destination.bucket)
    part = choose_part_size(size, sides.part_size)
    upload_id = await destination.create_multipart(key)
    try:
        parts: list[PartResult] = []
        for number, start in enumerate(range(0, size, part), start=1):
            end = min(start + part, size)
            if sides.server_side:
                source = (sides.source.bucket, source_key, start, end)
                parts.append(await destination.upload_part_copy(key, upload_id, number, source))
            else:
                body = await _read(sides.source, source_key, start, end)
                parts.append(
                    await destination.upload_part(key, upload_id, number, body, crc32c(body))
                )
        return await destination.complete_multipart(key, upload_id, parts)
    except BaseException:
        try:
            await destination.abort_multipart(key, upload_id)
        except StorageError as exc:  # gc aborts it later
            log.warning("could not abort the upload of %s: %s", key, exc)
        raise
