"""``S3StorageReader``: DCP's StorageReader for checkpoints written by S3StorageWriter.

Lifecycle of a load (the order DCP calls in):

0. ``reset(checkpoint_id)`` (all ranks, when ``checkpoint_id`` is passed to ``dcp.load``).
1. ``read_metadata()`` (all ranks): reads the manifest (no manifest, no checkpoint:
   :class:`~s3ckpt.errors.CheckpointNotFoundError`), then DCP's metadata object it names,
   checked against the manifest's size and CRC32C and unpickled with a restricted
   unpickler (:mod:`s3ckpt.dcp.metadata_pickle`). Given ``process_group=``, the group's
   rank 0 reads them and broadcasts both (or its error) to the other ranks, which make no
   request: one read per load, not one per rank. Without it every rank reads for itself
   and no collective is issued: s3ckpt never guesses the group a load runs on.
2. ``set_up_storage_reader(metadata, is_coordinator)`` (all ranks).
3. ``prepare_local_plan`` / ``prepare_global_plan``: DCP's planner decides which stored
   chunks (or parts of chunks, when resharding) each rank needs; the coordinator adds to
   every rank's plan the save it planned from and how many ranks load.
4. ``read_data(plan, planner)`` (all ranks): finds where its items are stored: in format 2
   by reading the index objects of just the ranks that stored them
   (:mod:`s3ckpt.format.rank_index`; which rank stored what is in DCP's metadata), in
   format 1 from DCP's metadata itself. Then turns every read item into a byte range,
   widened to whole checksum blocks, and fetches all of them with coalesced parallel
   ranged GETs (:mod:`s3ckpt.dcp.fetch` over :mod:`s3ckpt.transfer.download`). Bytes go straight into the destination tensor
   when it is a contiguous CPU tensor of the stored shape; otherwise into a scratch buffer
   that is then copied (narrowed, moved to the device). Every block is verified against
   its CRC32C before the item is committed; a mismatch raises
   :class:`~s3ckpt.errors.CorruptCheckpointError` naming the object and the item.

   A load never returns a state that mixes two saves. A rank that read another save than
   the coordinator's (an overwrite committed between their reads of the manifest), or a
   rank of a multi-rank load whose data object vanished (the checkpoint was overwritten
   and ``gc`` removed the replaced save), raises
   :class:`~s3ckpt.errors.CheckpointReplacedError` (:mod:`s3ckpt.dcp.overwrites`), which DCP
   hands to every rank. Only a
   load of one rank follows the overwrite, reading every item again from the newer save.

A load restores what was saved, or says what it did not. An optimizer placed in the state
as itself (``{"model": model, "optim": optimizer}``) gets every saved moment even when it
is fresh (:mod:`s3ckpt.dcp.optimizer_state`: in ``prepare_local_plan`` and ``read_data``).
Saved entries no rank's target took, and entries loaded with a dtype or shape conversion,
are logged once as one warning after the reads, or with ``strict=True`` raise
:class:`~s3ckpt.errors.StateMismatchError` before any byte is loaded
(:mod:`s3ckpt.dcp.load_report`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from s3ckpt.config import S3URI, S3Config, make_config
from s3ckpt.dcp import device_load, metadata_read
from s3ckpt.dcp.compat import (
    LoadPlan,
    LoadPlanner,
    Metadata,
    MetadataIndex,
    ReadItem,
    StorageReader,
    chunk_shapes,
    read_by_dcp_load,
    remember_metadata_failure,
    stand_in_metadata,
)
from s3ckpt.dcp.fetch import ItemFetch, ReadPlan, ReadSource
from s3ckpt.dcp.load_report import LoadReport, report_for
from s3ckpt.dcp.location import S3Location
from s3ckpt.dcp.optimizer_state import Fills, plan_fills
from s3ckpt.dcp.overwrites import (
    LoadAgreement,
    check_agreement,
    describes,
    latest_save_id,
    replaced_error,
)
from s3ckpt.dcp.owners import ChunkPositions
from s3ckpt.dcp.process_group import GroupBroadcast, SharedReads, shared_reads
from s3ckpt.dcp.restore import PendingRead, Stage, prepare
from s3ckpt.dcp.shared_read import SharedRead, in_device_memory
from s3ckpt.errors import (
    CheckpointError,
    CheckpointReplacedError,
    ConfigError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    S3CkptError,
)
from s3ckpt.format.layout import StoredItem
from s3ckpt.format.manifest import Manifest
from s3ckpt.format.rank_index import ItemOwners
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.rank_index import read_indexes

log = logging.getLogger(__name__)


class S3StorageReader(S3Location, StorageReader):
    """Load DCP checkpoints from ``s3://bucket/prefix``.

    Args:
        checkpoint_id: the location; may instead be passed to ``dcp.load(..., checkpoint_id=...)``.
        endpoint_url: the S3 endpoint.
        config: an :class:`~s3ckpt.config.S3Config`; keyword ``options`` override its fields.
        request_size: the largest ranged GET; larger ranges are split and fetched in parallel.
        decode_threads: worker threads decompressing compressed items.
        process_group: the ranks that call ``dcp.load`` together (the group given to
            ``dcp.load(process_group=...)``, or ``torch.distributed.group.WORLD``): their
            rank 0 reads the metadata once and broadcasts it over this group, which every
            one of them must therefore pass. ``None`` (the default): each rank reads it
            itself, with no collective. The ranks also read each stored range that several
            of them need once, passing it on over this group (:mod:`s3ckpt.dcp.shared_read`;
            in device memory for CUDA destinations where its backend for CUDA is NCCL).
        trust_pickles: load non-tensor items even if they hold objects outside torch's
            weights-only allowlist (custom classes), and metadata naming globals outside
            s3ckpt's allowlist. Only for buckets you trust: such pickles can run code.
        bounce_bytes: host memory (page-locked where CUDA is available) that items
            loaded into device memory pass through, in slabs of about ``request_size``
            (:mod:`s3ckpt.dcp.device_load`); 256 MiB by default.
        strict: raise :class:`~s3ckpt.errors.StateMismatchError` before any byte is
            loaded when a saved entry would be left out (no rank's target takes it) or
            loaded with a dtype or shape conversion (each rank checks its own targets
            before its first read). ``False`` (the default): load, then log what was left
            out or converted as one warning (logger ``s3ckpt.dcp.load_report``).
    """

    _dcp_call = "dcp.load"

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str] | None = None,
        *,
        endpoint_url: str | None = None,
        config: S3Config | None = None,
        request_size: int = 16 * 1024 * 1024,
        decode_threads: int = 2,
        trust_pickles: bool = False,
        process_group: dist.ProcessGroup | None = None,
        bounce_bytes: int = device_load.DEFAULT_BOUNCE_BYTES,
        strict: bool = False,
        **options: Any,
    ) -> None:
        super().__init__()
        self.config = make_config(config, endpoint_url=endpoint_url, **options)
        self.location: S3URI | None = None
        self._set_location(checkpoint_id)
        self.request_size = request_size
        self.decode_threads = decode_threads
        self.trust_pickles = trust_pickles
        self.process_group = process_group
        if bounce_bytes <= 0:
            raise ConfigError(f"bounce_bytes must be positive, not {bounce_bytes}")
        self.bounce_bytes = bounce_bytes
        self.manifest: Manifest | None = None
        self.metadata: Metadata | None = None
        self._failure: S3CkptError | None = None  # of read_metadata, for dcp.load
        self.storage_data: dict[MetadataIndex, StoredItem] = {}
        self._shapes: dict[MetadataIndex, tuple[torch.dtype, torch.Size]] = {}
        self.strict = strict
        self._report = LoadReport("", strict)
        self._fills = Fills([])

    # -- DCP lifecycle --------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._set_location(checkpoint_id)
        self.manifest = None
        self.storage_data = {}

    def read_metadata(self) -> Metadata:
        self._start_budget()  # the first call of every load
        self._report = report_for(str(self.location), self.strict)
        self._fills = Fills([])
        try:
            metadata = self._read_metadata()
        except S3CkptError as exc:
            remember_metadata_failure(exc)  # for unwrap(): dcp.load replaces the exception
            if read_by_dcp_load(sys._getframe(1)):  # raised at DCP's next call, as itself
                self._failure = exc
                return stand_in_metadata()
            raise
        remember_metadata_failure(None)
        return metadata

    def _read_metadata(self) -> Metadata:
        location = self._require_location()
        group = shared_reads(self.process_group)
        if group is None:
            manifest, body = io_loop().run(self._fetch_metadata(location))
        else:
            manifest, body = self._shared_metadata(location, group)
        return self._adopt(location, manifest, body)

    def _shared_metadata(self, location: S3URI, group: SharedReads) -> tuple[Manifest, bytes]:
        """The group's coordinator reads the manifest and metadata and broadcasts them."""
        outcome: metadata_read.Fetched | Exception | None = None
        if group.is_coordinator:
            try:
                outcome = io_loop().run(self._fetch_metadata(location))
            except Exception as exc:  # every rank raises it (metadata_read.shared)
                outcome = exc
        return metadata_read.shared(outcome, group)

    def _adopt(self, location: S3URI, manifest: Manifest, body: bytes) -> Metadata:
        """Check and unpickle the metadata object of ``manifest``; it is the save read."""
        metadata = metadata_read.unpickled(
            location, manifest, body, trust_pickles=self.trust_pickles
        )
        self.manifest = manifest
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:  # the metadata read failed (see read_metadata)
            raise failure
        if metadata.storage_data is None:
            raise CorruptCheckpointError(
                f"checkpoint metadata at {self.location} has no storage data"
            )
        self.metadata = metadata
        self.storage_data = {}
        self._shapes = chunk_shapes(metadata)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self.metadata is None:
            return plan
        plan, fills = plan_fills(self.metadata, plan)  # optimizer state with no target
        self._fills = Fills(fills)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if self.metadata is not None:
            self._report.find_dropped(self.metadata, plans, self._stored_size)
        # The coordinator names the save it planned from, and how many ranks load: every
        # rank checks that it read the same save, and only a lone rank follows an overwrite.
        agreed = LoadAgreement(self._manifest().save_id, len(plans))
        return [dataclasses.replace(plan, storage_data=agreed) for plan in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        agreed = plan.storage_data if isinstance(plan.storage_data, LoadAgreement) else None
        self._check_agreement(agreed)
        report = self._report
        targets, plan = self._fills.planner(planner, plan)
        if self.metadata is not None:
            report.check_targets(plan, targets, self.metadata)
            targets = report.watching(targets, self.metadata)
        for _ in range(metadata_read.OVERWRITES_FOLLOWED):
            try:
                self._read_all(plan, targets)
                break
            except ObjectNotFoundError as exc:
                if agreed is None or agreed.ranks != 1:
                    raise self._replaced(exc) from exc
                self._follow_overwrite(plan, exc)
        else:
            raise CorruptCheckpointError(
                f"{self.location} was overwritten {metadata_read.OVERWRITES_FOLLOWED} times during one load"
            )
        if self.retries:
            log.info("load of %s: %d request(s) retried", self.location, self.retries)
        self._fills.install(planner)
        report.add_left_out(self._fills.left_out, self.metadata)
        report.finish()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _locate(self, plan: LoadPlan) -> None:
        """Where every item of ``plan`` is stored, into :attr:`storage_data`."""
        location, metadata = self._require_location(), self.metadata
        if metadata is None:
            raise CheckpointError("read_data before set_up_storage_reader")
        if not isinstance(metadata.storage_data, ItemOwners):  # format 1: in the metadata
            self.storage_data = metadata.storage_data
            return
        self.storage_data = io_loop().run(
            _stored_items(self._store(), location, self._manifest(), metadata, plan)
        )

    def _stored_size(self, fqn: str) -> int | None:
        """A non-tensor entry's stored bytes, where the metadata records them (format 1)."""
        stored = self.metadata.storage_data if self.metadata is not None else None
        if not isinstance(stored, dict):
            return None
        return sum(item.size for index, item in stored.items() if index.fqn == fqn) or None

    def _manifest(self) -> Manifest:
        if self.manifest is None:
            raise CheckpointError("read_data before read_metadata")
        return self.manifest

    def _read_all(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        group = shared_reads(self.process_group)
        if isinstance(group, GroupBroadcast):
            try:
                planned: ReadPlan | Exception = self._read_plan(
                    plan, planner, stage=in_device_memory(group)
                )
            except Exception as exc:  # every rank of the group learns it (SharedRead.run)
                planned = exc
            SharedRead(group).run(planned, planner)
            return
        read = self._read_plan(plan, planner)
        ItemFetch(read.source).run(read.items, planner)

    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner, *, stage: Stage = True) -> ReadPlan:
        """The one description of this ``read_data`` that the fetches run: where every item
        of ``plan`` is stored, where its bytes land, and its checks."""
        self._locate(plan)
        items = [self._prepare(request, planner, stage=stage) for request in plan.items]
        return ReadPlan(items, self._source())

    def _source(self) -> ReadSource:
        """Where and how the fetches of a ``read_data`` read."""
        return ReadSource(
            self._store(),
            self._require_location(),
            self.request_size,
            self.bounce_bytes,
            self.decode_threads,
            self.trust_pickles,
        )

    def _check_agreement(self, agreed: LoadAgreement | None) -> None:
        check_agreement(self.location, self._manifest().save_id, agreed)

    def _replaced(self, missing: ObjectNotFoundError) -> S3CkptError:
        location = self._require_location()
        latest = io_loop().run(latest_save_id(self._store(), location, missing))
        return replaced_error(location, self._manifest().save_id, latest, missing)

    def _follow_overwrite(self, plan: LoadPlan, missing: ObjectNotFoundError) -> None:
        """After a data object went missing mid-load: switch to the save that replaced the
        one being read, so the load starts over on it; a missing object of the save still
        committed is a damaged checkpoint.

        An overwrite keeps the replaced save's objects for ``gc``'s grace period, so this
        happens only to loads that outlast it. Every item is read again from the newer
        save, so the state never mixes the two.
        """
        location = self._require_location()
        before = self.manifest.save_id if self.manifest else None
        manifest, body = io_loop().run(self._fetch_metadata(location))
        if manifest.save_id == before:
            raise CorruptCheckpointError(
                f"{location} is committed but its object {missing.key} is missing"
            ) from missing
        metadata = self._adopt(location, manifest, body)
        if not describes(metadata, plan):
            raise CheckpointReplacedError(
                f"{location} was overwritten during the load by a checkpoint with other "
                "contents; load it again"
            ) from missing
        self.set_up_storage_reader(metadata, is_coordinator=False)
        log.info("%s was overwritten during the load; reading save %s", location, manifest.save_id)

    # -- helpers ---------------------------------------------------------------------------

    async def _fetch_metadata(self, location: S3URI) -> tuple[Manifest, bytes]:
        return await metadata_read.fetch_metadata(self._store(), location)

    def _prepare(self, request: ReadItem, planner: LoadPlanner, *, stage: Stage) -> PendingRead:
        stored = self.storage_data[request.storage_index]
        what = f"{self.location}/{stored.key} item {request.storage_index.fqn!r}"
        shape = self._shapes.get(request.storage_index)
        return prepare(request, stored, shape, planner, what, stage=stage)


async def _stored_items(
    store: ObjectStore, location: S3URI, manifest: Manifest, metadata: Metadata, plan: LoadPlan
) -> dict[MetadataIndex, StoredItem]:
    """Format 2: the stored records of ``plan``'s items, from the index objects of only
    the ranks that stored them."""
    owners: ItemOwners = metadata.storage_data
    positions = ChunkPositions(metadata)
    wanted: dict[MetadataIndex, int] = {}
    for request in plan.items:
        index = request.storage_index
        try:
            wanted[index] = owners.rank_of(index.fqn, positions.of(index))
        except KeyError as exc:
            raise CorruptCheckpointError(
                f"{location}: no rank stored {index.fqn!r} at {list(index.offset or ())}"
            ) from exc
    indexes = await read_indexes(store, location, manifest, wanted.values())
    tables = {rank: index.by_index() for rank, index in indexes.items()}
    found: dict[MetadataIndex, StoredItem] = {}
    for index, rank in wanted.items():
        entry = tables[rank].get((index.fqn, tuple(index.offset or ())))
        if entry is None:
            raise CorruptCheckpointError(
                f"{location}: the index object of rank {rank} has no {index.fqn!r} at "
                f"{list(index.offset or ())}"
            )
        found[index] = entry.stored
    return found
