"""``s3ckpt cp``: a committed checkpoint copied to another prefix, bucket or endpoint.

The copy follows the same rules as a save, so the destination never shows half a
checkpoint and ``gc``/``prune`` there never take it for garbage:

1. the source must be committed (its manifest names every object: ``Manifest.all_keys``);
   the destination must not be, unless ``overwrite``;
2. an in-flight record at the destination (:mod:`s3ckpt.transfer.inflight`), refreshed
   while the copy runs;
3. every object copied under its own relative key (:mod:`s3ckpt.interop.objects`:
   server-side on one endpoint, streamed with per-part CRC32Cs otherwise), several at once;
4. the copy verified: every item re-read at the destination and checked against its
   CRC32Cs by the catalog's verifier (:mod:`s3ckpt.catalog.verify`);
5. the manifest, with the destination's ETags, committed last
   (:func:`s3ckpt.transfer.commit.commit_manifest`: conditional create or claims, or an
   atomic replacement with ``overwrite``).

Any failure deletes what the copy wrote and leaves the destination as it was. Keys keep
the source's save id, so a destination that already holds this very save is refused.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from s3ckpt.catalog.reporting import SILENT, Reporter
from s3ckpt.catalog.scan import open_store, read_committed
from s3ckpt.catalog.verify import DEFAULT_MAX_BUFFER, Verifier
from s3ckpt.config import S3URI, S3Config
from s3ckpt.errors import (
    CheckpointExistsError,
    ConfigError,
    CorruptCheckpointError,
    StorageError,
)
from s3ckpt.format.manifest import Manifest
from s3ckpt.interop.objects import (
    COPY_OBJECT_LIMIT,
    STREAM_PART_SIZE,
    Endpoints,
    copy_object,
)
from s3ckpt.s3.loop import bounded, io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.commit import commit_manifest, committed_save_id
from s3ckpt.transfer.inflight import Heartbeat, clear_in_flight, mark_in_flight
from s3ckpt.transfer.parts import MAX_PART_SIZE, MIN_PART_SIZE

PARALLEL_COPIES = 8  # objects copied at once (a streamed one holds one part in memory)
log = logging.getLogger(__name__)


@dataclass
class CopyReport:
    """What a copy did: ``server_side`` tells which way the bytes went."""

    source: str
    destination: str
    save_id: str
    objects: int
    bytes: int
    server_side: bool
    verified_bytes: int


def copy_checkpoint(
    source: str | S3URI,
    destination: str | S3URI,
    *,
    overwrite: bool = False,
    config: S3Config | None = None,
    destination_config: S3Config | None = None,
    max_buffer: int = DEFAULT_MAX_BUFFER,
    copy_object_limit: int = COPY_OBJECT_LIMIT,
    part_size: int = STREAM_PART_SIZE,
    progress: Reporter = SILENT,
    **options: Any,
) -> CopyReport:
    """Copy the committed checkpoint at ``source`` to ``destination`` (module docstring).

    ``config`` and ``options`` configure the source's endpoint, and the destination's too
    unless ``destination_config`` names another. ``max_buffer`` bounds the verifier's
    memory; ``part_size`` is the part of multipart copies (streamed ones hold one part per
    object in flight); objects over ``copy_object_limit`` are copied in parts even on one
    endpoint. Raises :class:`~s3ckpt.errors.CheckpointNotFoundError` (nothing committed at
    ``source``), :class:`~s3ckpt.errors.CheckpointExistsError` (``destination``
    committed, no ``overwrite``), :class:`~s3ckpt.errors.CorruptCheckpointError` (the
    copy failed verification; nothing is committed).
    """
    src, src_location = open_store(source, config, options, require_prefix=True)
    dst_config = destination_config or src.config
    dst, dst_location = open_store(destination, dst_config, {}, require_prefix=True)
    if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
        raise ConfigError(f"part_size must be between 5 MiB and 5 GiB, got {part_size}")
    sides = Endpoints(src, dst, copy_object_limit=copy_object_limit, part_size=part_size)
    if sides.server_side and (src.bucket, src_location.prefix) == (
        dst.bucket,
        dst_location.prefix,
    ):
        raise ConfigError(f"cannot copy {src_location} onto itself")
    manifest = io_loop().run(read_committed(src, src_location))
    io_loop().run(_check_destination(dst, dst_location, manifest, overwrite))
    job = _Copy(sides, src_location, dst_location, manifest, progress)
    io_loop().run(mark_in_flight(dst, dst_location, manifest.save_id))
    try:
        with Heartbeat(dst, dst_location, manifest.save_id):
            verified = job.run(overwrite, max_buffer)
    finally:
        io_loop().run(clear_in_flight(dst, dst_location, manifest.save_id))
    return CopyReport(
        str(src_location),
        str(dst_location),
        manifest.save_id,
        len(manifest.all_keys()),
        job.total,
        sides.server_side,
        verified,
    )


async def _check_destination(
    store: ObjectStore, location: S3URI, manifest: Manifest, overwrite: bool
) -> None:
    await store.head_bucket()  # a missing bucket says so before anything is written
    present = await committed_save_id(store, location)
    if present == manifest.save_id:
        raise CheckpointExistsError(f"{location} already holds this checkpoint (save {present})")
    if present is not None and not overwrite:
        raise CheckpointExistsError(
            f"a checkpoint is already committed at {location} (pass --overwrite to replace it)"
        )


def _verify(
    store: ObjectStore, location: S3URI, manifest: Manifest, max_buffer: int, progress: Reporter
) -> int:
    """Re-read the copy before committing it; :class:`CorruptCheckpointError` if damaged."""
    report = Verifier(store, location, manifest, max_buffer).run(progress)
    if not report.ok:
        first = report.problems[0]
        raise CorruptCheckpointError(
            f"the copy at {location} failed verification ({len(report.problems)} problem(s), "
            f"first: {first.what} in {first.key}: {first.message}); nothing was committed"
        )
    return report.bytes


class _Copy:
    """Copies every object of a checkpoint, under an in-flight record at the destination."""

    def __init__(
        self,
        sides: Endpoints,
        source: S3URI,
        destination: S3URI,
        manifest: Manifest,
        progress: Reporter,
    ) -> None:
        self.sides, self.source, self.destination = sides, source, destination
        self.manifest, self.progress = manifest, progress
        self.written: list[str] = []

    @property
    def total(self) -> int:
        return self.manifest.total_bytes

    def run(self, overwrite: bool, max_buffer: int) -> int:
        """Copy, verify and commit; the bytes verified. On failure, nothing stays behind."""
        store, location = self.sides.destination, self.destination
        try:
            etags = io_loop().run(self._copy_all())
            copied = dataclasses.replace(
                self.manifest,
                objects=tuple(
                    dataclasses.replace(o, etag=etags[o.key]) for o in self.manifest.objects
                ),
            )
            verified = _verify(store, location, copied, max_buffer, self.progress)
            io_loop().run(commit_manifest(store, location, copied, overwrite=overwrite))
            return verified
        except BaseException:
            io_loop().run(self.discard())
            raise

    async def _copy_all(self) -> dict[str, str]:
        sizes = await self._sizes()
        self.progress.start("copying", sum(sizes.values()), "bytes")
        keys = self.manifest.all_keys()
        etags = await bounded([lambda k=k: self._one(k, sizes[k]) for k in keys], PARALLEL_COPIES)
        self.progress.finish()
        return dict(zip(keys, etags, strict=True))

    async def _sizes(self) -> dict[str, int]:
        """The size of every object of the source, from one listing; a missing one is damage."""
        prefix = self.source.key("")
        found = {m.key[len(prefix) :]: m.size async for m in self.sides.source.list(prefix)}
        missing = [k for k in self.manifest.all_keys() if k not in found]
        if missing:
            raise CorruptCheckpointError(
                f"{self.source} is damaged: {len(missing)} object(s) its manifest names are "
                f"missing, first {missing[0]}"
            )
        return {k: found[k] for k in self.manifest.all_keys()}

    async def _one(self, key: str, size: int) -> str:
        self.written.append(key)
        etag = await copy_object(self.sides, self.source.key(key), self.destination.key(key), size)
        self.progress.advance(size)
        return etag

    async def discard(self) -> None:
        """Delete what this copy wrote, unless its manifest landed after all (a commit whose
        response was lost): then the copy is committed and everything stays."""
        store, location = self.sides.destination, self.destination
        try:
            if await committed_save_id(store, location) == self.manifest.save_id:
                return
            await store.delete_many([location.key(k) for k in self.written])
        except StorageError as exc:  # gc removes them after its grace period
            log.warning("could not delete the partial copy at %s: %s", location, exc)
