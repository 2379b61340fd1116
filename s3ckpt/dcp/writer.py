"""``S3StorageWriter``: DCP's StorageWriter for S3, committed atomically by a manifest.

Lifecycle of a save (the order DCP calls in, see ``torch.distributed.checkpoint.storage``):

0. ``reset(checkpoint_id)`` (all ranks, when ``checkpoint_id`` is passed to ``dcp.save``):
   point the writer at a location and start a new save id.
1. ``set_up_storage_writer(is_coordinator, rank=...)`` (all ranks).
2. ``prepare_local_plan(plan)`` (all ranks): the coordinator reads the manifest at the
   location (one GET, :func:`~s3ckpt.transfer.commit.manifest_exists`): a missing bucket,
   a ``manifest.json`` that is not s3ckpt's (overwrite or not: s3ckpt never writes over
   another tool's) and, unless ``overwrite=True``, a committed checkpoint fail the save
   before any object is written.
3. ``prepare_global_plan(plans)`` (coordinator): gives every rank its rank number and the
   coordinator's save id, which names all objects of this save.
4. ``write_data(plan, planner)`` (all ranks, :mod:`s3ckpt.dcp.rank_save`): under the
   save id of the plan's rank assignment (or one of its own when the plan was replayed from
   a planner's cache, :mod:`s3ckpt.dcp.save_identity`), streams the rank's items zero-copy
   (or compressed, :mod:`s3ckpt.format.compression`) into :class:`~s3ckpt.transfer.upload.RankUploader`,
   which packs them into a few data objects sent as PUTs and multipart uploads, then
   writes the rank's index object (:mod:`s3ckpt.format.rank_index`): per item a
   :class:`~s3ckpt.format.layout.StoredItem`, its object, offset, length and block
   CRC32Cs. A failure aborts and deletes everything the rank uploaded.
5. ``finish(metadata, results)`` (coordinator, :mod:`s3ckpt.dcp.save_commit`): records in
   DCP's metadata which rank stored each chunk, checks that every object of the save is
   there and that the metadata loads, writes the metadata object, then the manifest
   (:mod:`s3ckpt.transfer.commit`): the commit. Before it, the checkpoint does not exist.
   Then the objects of ``after_commit`` (a trainer's ``latest`` file), so that every
   rank's ``dcp.save`` returns only once they name the committed checkpoint.

The writer holds only its configuration and location, so it pickles (process-mode
``async_save``) and works after ``fork``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from torch.futures import Future

from s3ckpt.config import MAX_KEY_BYTES, S3URI, S3Config, check_key_room, make_config
from s3ckpt.dcp.compat import (
    Metadata,
    SavePlan,
    SavePlanner,
    StorageMeta,
    StorageWriter,
    WriteResult,
)
from s3ckpt.dcp.local_plan import ReusingSavePlanner
from s3ckpt.dcp.location import S3Location
from s3ckpt.dcp.rank_save import RankSave, RankTarget, rank_name
from s3ckpt.dcp.save_commit import SaveCommit
from s3ckpt.dcp.save_identity import RankAssignment, claim
from s3ckpt.errors import CheckpointExistsError, ConfigError, InvalidURIError
from s3ckpt.format.compression import Compression
from s3ckpt.format.layout import (
    DEFAULT_MAX_OBJECT_SIZE,
    SPREAD_WIDTHS,
    claim_key,
    data_key,
    index_key,
    metadata_key,
    saving_key,
)
from s3ckpt.format.manifest import MANIFEST_NAME, new_save_id
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.commit import PROBE_NAME, manifest_exists
from s3ckpt.transfer.inflight import Heartbeat, clear_in_flight, mark_in_flight
from s3ckpt.transfer.parts import MAX_OBJECT_SIZE, MIN_PART_SIZE
from s3ckpt.transfer.thread_mode import gil_tuned

log = logging.getLogger(__name__)


class S3StorageWriter(S3Location, StorageWriter):
    """Save DCP checkpoints to ``s3://bucket/prefix``.

    Args:
        checkpoint_id: the location, ``s3://bucket/prefix``; may instead be passed to
            ``dcp.save(..., checkpoint_id=...)``.
        endpoint_url: the S3 endpoint, e.g. ``https://flashblade.example.com``.
        config: an :class:`~s3ckpt.config.S3Config`; keyword ``options`` override its fields.
        overwrite: replace a committed checkpoint at the location (atomically); by default
            saving over one raises :class:`~s3ckpt.errors.CheckpointExistsError`. A
            ``manifest.json`` there that is not s3ckpt's is never replaced: the save
            raises :class:`~s3ckpt.errors.ForeignObjectError` before writing anything.
        max_object_size: the largest data object a rank writes before starting another.
        compression: ``"zstd"`` (or a :class:`~s3ckpt.format.compression.Compression`) to store
            items zstd-compressed per checksum block, floating-point ones byte-grouped;
            off by default. ``compression_level`` sets the zstd level (default 1).
        spread_prefixes: put data objects under 16, 256 or 4096 hashed key prefixes inside
            the checkpoint, for stores that limit request rates per prefix (AWS S3); 0 (the
            default) keeps them under ``data/``, which FlashBlade needs no more than.
        after_commit: objects the coordinator puts once the checkpoint is committed,
            ``{"s3://bucket/key": body}`` in the checkpoint's bucket (a trainer's pointer
            to its newest checkpoint): written before any rank's save returns, so a
            background save is over only when they are; if one fails the save raises
            :class:`~s3ckpt.errors.CheckpointError` on every rank (the checkpoint itself
            stays committed).
    """

    _dcp_call = "dcp.save"

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str] | None = None,
        *,
        endpoint_url: str | None = None,
        config: S3Config | None = None,
        overwrite: bool = False,
        max_object_size: int = DEFAULT_MAX_OBJECT_SIZE,
        compression: str | Compression | None = None,
        compression_level: int | None = None,
        spread_prefixes: int = 0,
        after_commit: Mapping[str, bytes] | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        self.config = make_config(config, endpoint_url=endpoint_url, **options)
        self.compression = Compression.parse(compression, compression_level)
        if not MIN_PART_SIZE <= max_object_size <= MAX_OBJECT_SIZE:
            raise ConfigError(
                f"max_object_size must be between 5 MiB and 5 TiB (S3's limits), got {max_object_size}"
            )
        if spread_prefixes not in SPREAD_WIDTHS:
            raise ConfigError(
                f"spread_prefixes must be 0, 16, 256 or 4096, got {spread_prefixes!r}"
            )
        self.spread_prefixes = spread_prefixes
        self.overwrite = overwrite
        self.max_object_size = max_object_size
        self.after_commit = _after_commit_objects(after_commit)
        self.location: S3URI | None = None
        self._set_location(checkpoint_id)
        self.save_id = new_save_id()
        self.is_coordinator = False
        self.rank: int | None = None  # DCP passes it; callers of the bare API may not
        # The save whose in-flight record this writer last wrote, and when (monotonic, taken
        # before the PUT, so that the server's LastModified is no older).
        self._marked: tuple[str, float] | None = None

    # -- DCP lifecycle --------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._set_location(checkpoint_id)
        self.save_id = new_save_id()

    def _set_location(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        """Parse the location and refuse one whose keys S3 could not hold (the longest a
        save writes under it, :func:`longest_name`)."""
        super()._set_location(checkpoint_id)
        if checkpoint_id is not None and self.location is not None:
            check_key_room(self.location, longest_name(self.spread_prefixes), "checkpoint")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self._start_budget()
        # A writer reused for another save without a new checkpoint_id (so without reset)
        # still needs fresh object keys: an overwrite must never touch the committed ones.
        self.save_id = new_save_id()
        rank = kwargs.get("rank")
        self.rank = None if rank is None else int(rank)
        if kwargs.get("use_collectives", True) is False:
            raise ConfigError(
                "S3StorageWriter needs use_collectives=True: the coordinator commits for all ranks"
            )
        location = self._require_location()
        for target, _ in self.after_commit:
            if target.bucket != location.bucket:
                raise ConfigError(
                    f"after_commit objects must be in the checkpoint's bucket "
                    f"{location.bucket}, got {target}"
                )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.is_coordinator:
            io_loop().run(self._check_target())
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Before any rank writes an object: gc and prune must see this save from the start.
        self._marked = (self.save_id, time.monotonic())
        io_loop().run(mark_in_flight(self._store(), self._require_location(), self.save_id))
        return [
            dataclasses.replace(plan, storage_data=RankAssignment(rank, self.save_id))
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assignment = self.assignment(plan)
        future: Future[list[WriteResult]] = Future()
        future.set_result(self.write_assigned(plan, planner, assignment))
        return future

    def assignment(self, plan: SavePlan) -> RankAssignment:
        """The rank and save id ``write_data`` writes ``plan`` under (:mod:`.save_identity`).

        Callers that write in another process than the one that planned (Megatron's
        async saves fork or hand the write to a worker) take it here, in the planning
        process, where the replays of cached plans are remembered, then call
        :meth:`write_assigned` wherever the bytes are written.
        """
        return self._assignment(plan, self._store(), self._require_location())

    def write_assigned(
        self, plan: SavePlan, planner: SavePlanner, assignment: RankAssignment
    ) -> list[WriteResult]:
        """Write ``plan``'s items under ``assignment``: ``write_data`` after its assignment."""
        store, location = self._store(), self._require_location()
        try:
            with Heartbeat(store, location, assignment.save_id):
                target = RankTarget(
                    store, location, self.spread_prefixes, self.max_object_size, self.compression
                )
                try:
                    results = RankSave(target, assignment).run(plan.items, planner)
                finally:
                    _let_go_of_state(planner)
        except BaseException:
            # The save cannot commit now: nothing of it is in flight any more.
            io_loop().run(clear_in_flight(store, location, assignment.save_id))
            raise
        if self.retries:
            log.info(
                "save %s: rank %s retried %d request(s)",
                assignment.save_id,
                rank_name(self.rank),
                self.retries,
            )
        return results

    def _assignment(self, plan: SavePlan, store: ObjectStore, location: S3URI) -> RankAssignment:
        """The rank and save id this ``write_data`` writes under (:mod:`.save_identity`).

        A plan replayed from a planner's cache gets a save id of its own; its in-flight
        record is written before any of its objects, and the coordinator commits under it.
        """
        rank = self.rank
        if rank is None:  # no rank from DCP: trust the plan's
            rank = getattr(plan.storage_data, "rank", 0)
        assignment = claim(plan.storage_data, rank)
        if assignment != plan.storage_data:
            log.info("save plan replayed from a cache: writing it as save %s", assignment.save_id)
            self._marked = (assignment.save_id, time.monotonic())
            io_loop().run(mark_in_flight(store, location, assignment.save_id))
        if self.is_coordinator and assignment.save_id != self.save_id:
            marked, self.save_id = self.save_id, assignment.save_id
            io_loop().run(clear_in_flight(store, location, marked))
        return assignment

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        location = self._require_location()
        metadata.storage_meta = self.storage_meta()
        marked_at = self._marked[1] if self._marked and self._marked[0] == self.save_id else None
        commit = SaveCommit(self._store(), location, self.save_id, self.overwrite, marked_at)
        commit.run(metadata, results, self.after_commit)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(
            checkpoint_id=str(self.location) if self.location else None, save_id=self.save_id
        )

    # -- helpers ---------------------------------------------------------------------------

    async def _check_target(self) -> None:
        """One GET of the manifest (see the module docstring, step 2)."""
        store, location = self._store(), self._require_location()
        if await manifest_exists(store, location) and not self.overwrite:
            raise CheckpointExistsError(
                f"Checkpoint already exists: {location} is already committed; pass "
                "overwrite=True to replace it"
            )


def _after_commit_objects(objects: Mapping[str, bytes] | None) -> tuple[tuple[S3URI, bytes], ...]:
    """``after_commit`` checked: object URIs (a key, not a bucket) and bytes bodies."""
    checked = []
    for uri, body in (objects or {}).items():
        if not isinstance(body, bytes | bytearray | memoryview):
            raise ConfigError(
                f"after_commit bodies must be bytes, got {type(body).__name__} for {uri}"
            )
        target = S3URI.parse(uri)
        size = len(target.prefix.encode())
        if size > MAX_KEY_BYTES:
            raise InvalidURIError(
                f"after_commit key {target.prefix[:60]!r}... is {size:,} bytes of UTF-8, over "
                f"S3's limit of {MAX_KEY_BYTES:,} bytes"
            )
        checked.append((target, bytes(body)))
    return tuple(checked)


def longest_name(spread: int = 0) -> str:
    """The longest name a save writes under its checkpoint's prefix, with ``spread``
    (``spread_prefixes``): the object that probes a store for conditional writes
    (:data:`~s3ckpt.transfer.commit.PROBE_NAME`, at a process's first commit to a bucket), else a data object's,
    its rank and object number as wide as their names are padded
    (``data/<hex>/r00000-<save id>-0000.bin``), or an index, the metadata, an in-flight
    record or a claim where longer. What must fit in S3's key limit with the prefix."""
    save_id = "0" * len(new_save_id())
    spread = spread if spread in SPREAD_WIDTHS else max(SPREAD_WIDTHS)  # refused elsewhere
    names = (
        PROBE_NAME,
        data_key(0, save_id, 0, spread),
        index_key(0, save_id, spread),
        metadata_key(save_id),
        saving_key(save_id),
        claim_key(save_id),
        MANIFEST_NAME,
    )
    return max(names, key=len)


def _let_go_of_state(planner: SavePlanner) -> None:
    """Once every item is written, a :class:`ReusingSavePlanner` drops its view of the
    state dict (DCP asks nothing more of it in this save), where
    :func:`~s3ckpt.transfer.thread_mode.gil_tuned`.

    Otherwise that view lives until the next save's ``set_up_planner``, on DCP's save
    thread, and replacing it there frees the previous copy's tensors: each free lets the
    GIL go and takes it back, one hand-over per tensor beside the training loop. Let go
    here, the last reference is the stager's (``HostStager`` keeps its copy until the next
    stage), so the tensors are freed on the caller's thread between saves."""
    if gil_tuned() and isinstance(planner, ReusingSavePlanner):
        planner.let_go()
