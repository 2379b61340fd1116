"""The commit of a save: DCP's ``finish``, on the coordinator, once every rank has written.

:meth:`SaveCommit.run` records in DCP's metadata which rank stored each chunk; refreshes
the in-flight record where the coordinator wrote it a heartbeat or more ago
(:mod:`s3ckpt.transfer.inflight`) and checks that every object of the save is there,
while a worker thread checks that the metadata loads as a default load reads it; writes
the metadata object, then the manifest (:mod:`s3ckpt.transfer.commit`): the commit.
Before it, the checkpoint does not exist. Then the objects of ``after_commit``.

A save that does not commit (it lost a race, an object vanished, the store failed)
deletes everything it wrote, unless the manifest turns out to name it after all (a
commit whose response was lost). Everything it needs comes in as values (the writer's
store, location, save id and options), so it never calls back into the writer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from s3ckpt.config import S3URI
from s3ckpt.dcp import metadata_pickle as dcp_metadata
from s3ckpt.dcp.compat import TORCH_VERSION, Metadata, WriteResult
from s3ckpt.dcp.owners import ChunkPositions
from s3ckpt.dcp.rank_save import RankRecord
from s3ckpt.errors import CheckpointError, S3CkptError
from s3ckpt.format.layout import HEARTBEAT_S
from s3ckpt.format.manifest import Manifest
from s3ckpt.format.rank_index import ItemOwners
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.commit import commit_manifest, committed_save_id, confirm_objects
from s3ckpt.transfer.inflight import clear_in_flight, mark_in_flight

log = logging.getLogger("s3ckpt.dcp.writer")  # the writer's: the commit is its ``finish``

AfterCommit = tuple[tuple[S3URI, bytes], ...]
"""Objects put once the checkpoint is committed, in order: ``(target, body)``."""


@dataclass(frozen=True)
class SaveCommit:
    """The coordinator's commit of save ``save_id`` at ``location``.

    Args:
        store: the store of the location's bucket, under the save's retry budget.
        location: the checkpoint.
        save_id: the coordinator's save id: the manifest names it.
        overwrite: replace a committed checkpoint at the location.
        marked_at: ``time.monotonic()`` when the coordinator last wrote this save's
            in-flight record (taken before the PUT), None if it did not: a record younger
            than :data:`~s3ckpt.format.layout.HEARTBEAT_S` is not written again.
    """

    store: ObjectStore
    location: S3URI
    save_id: str
    overwrite: bool
    marked_at: float | None = None

    def run(
        self, metadata: Metadata, results: list[list[WriteResult]], after_commit: AfterCommit = ()
    ) -> None:
        """Commit the save whose ranks returned ``results``, then put ``after_commit``.

        Raises what stopped the commit (the save's objects deleted), or
        :class:`~s3ckpt.errors.CheckpointError` when an ``after_commit`` object could not be
        written (the checkpoint stays committed).
        """
        flat = [wr for rank_results in results for wr in rank_results]
        metadata.storage_data = item_owners(metadata, flat)
        io_loop().run(self._commit(metadata, rank_records(results), len(results)))
        io_loop().run(self._put_after_commit(after_commit))

    async def _commit(self, metadata: Metadata, records: list[RankRecord], world_size: int) -> None:
        """Metadata object, a check that every object is still there, then the manifest."""
        store, location = self.store, self.location
        body = dcp_metadata.dumps(metadata)
        manifest = Manifest.of_save(
            self.save_id,
            world_size,
            body,
            objects=tuple(o for record in records for o in record.objects),
            indexes=tuple(record.index for record in records),
            torch_version=TORCH_VERSION,
        )
        sizes = {o.key: o.size for o in manifest.objects} | {
            i.key: i.size for i in manifest.indexes
        }
        try:
            # Reading the metadata back costs about one unpickle, more than its pickle: it
            # runs on a worker thread while the listings that confirm the objects are on
            # the wire (docs/decisions/0008-thread-mode-gil.md).
            checked = asyncio.ensure_future(
                asyncio.to_thread(dcp_metadata.check_loadable, body, str(location))
            )
            try:
                if not self._record_is_fresh():
                    await mark_in_flight(store, location, self.save_id)
                await confirm_objects(store, location, sizes)
            finally:
                await asyncio.wait([checked])
            checked.result()
            await store.put(
                location.key(manifest.metadata_key), body, crc32c=manifest.metadata_crc32c
            )
            await commit_manifest(store, location, manifest, overwrite=self.overwrite)
        except Exception:
            if not await self._committed_anyway():
                await self._discard(manifest, records)
                raise
        for save_id in save_ids(records, self.save_id):
            await clear_in_flight(store, location, save_id)

    def _record_is_fresh(self) -> bool:
        """Whether the coordinator wrote the save's in-flight record less than
        :data:`HEARTBEAT_S` ago: it then holds ``gc`` and ``prune`` off the directory for
        :data:`LEASE_S` minus that, minutes more than a commit takes, and the commit
        refreshes it only where the save ran longer (one request less on the commit's
        path: a round trip to the store, and the I/O loop's Python beside a thread-mode
        save's training loop; docs/decisions/0008-thread-mode-gil.md)."""
        if self.marked_at is None:
            return False
        return time.monotonic() - self.marked_at < HEARTBEAT_S

    async def _put_after_commit(self, after_commit: AfterCommit) -> None:
        """The ``after_commit`` objects, in order; the first failure raises."""
        for target, body in after_commit:
            try:
                await self.store.put(target.prefix, body)
            except S3CkptError as exc:
                raise CheckpointError(
                    f"{self.location} is committed, but {target} could not be written: {exc}"
                ) from exc

    async def _committed_anyway(self) -> bool:
        """Whether the manifest names this save although committing raised; True too when
        that cannot be told (nothing is deleted then: gc decides later)."""
        try:
            return await committed_save_id(self.store, self.location) == self.save_id
        except S3CkptError as exc:
            log.warning("save %s failed and %s is unreadable: %s", self.save_id, self.location, exc)
            return True

    async def _discard(self, manifest: Manifest, records: list[RankRecord]) -> None:
        """Delete every object of a save that did not commit, its in-flight records last."""
        try:
            await self.store.delete_many([self.location.key(k) for k in manifest.all_keys()])
        except S3CkptError as exc:
            log.warning("could not delete the objects of failed save %s: %s", self.save_id, exc)
            return
        for save_id in save_ids(records, self.save_id):
            await clear_in_flight(self.store, self.location, save_id)


def save_ids(records: list[RankRecord], coordinator: str) -> list[str]:
    """Every save id the ranks of one save wrote under (one, unless plans were replayed)."""
    return sorted({coordinator} | {r.save_id for r in records if r.save_id})


def rank_records(results: list[list[WriteResult]]) -> list[RankRecord]:
    """What each rank wrote (its objects and index), by rank, from DCP's write results."""
    records = {wr.storage_data.rank: wr.storage_data for rr in results for wr in rr}
    return sorted(records.values(), key=lambda r: r.rank)


def item_owners(metadata: Metadata, results: list[WriteResult]) -> ItemOwners:
    """Which rank stored each chunk of DCP's metadata (:class:`ItemOwners`)."""
    counts = {
        fqn: len(getattr(md, "chunks", ())) or 1 for fqn, md in metadata.state_dict_metadata.items()
    }
    positions = ChunkPositions(metadata)
    owned = [(wr.index.fqn, positions.of(wr.index), wr.storage_data.rank) for wr in results]
    return ItemOwners.build(counts, owned)
