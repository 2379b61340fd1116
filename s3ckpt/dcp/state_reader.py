"""``StateReader``: a DCP ``StorageReader`` over a state dict already in memory.

The memory tier restores a rank from its held copy (:mod:`s3ckpt.tier.restore`): a state
dict whose tensors lie in shared memory, staged exactly as a save would write it. Loading
it through ``dcp.load`` rather than copying tensors by name keeps DCP's semantics for
free: ``Stateful`` objects get their ``load_state_dict``, the same keys must match, and
DTensor or ShardedTensor targets take the shards they need by offset.

The metadata is what a save of that state would write: DCP's own save planner run on it
(no collective, one rank's plan). Each read copies the chunk the load planner asks for
from the held tensor (a view, so a byte is read once) into the target; or, given
``copy_in``, hands every ``(source, target)`` pair of the plan to it at once, so the
memory tier can read its copy's files into the targets and check them as they land
(:mod:`s3ckpt.tier.copy_in`).

Given the states of every rank of a save (:class:`StateReader` takes them all), the metadata is
the one that save wrote: DCP's coordinator planner merges the ranks' plans (replicated
items kept once, as a save keeps them), so a job with another world size or sharding
loads from them as it would load the checkpoint from S3, each chunk read from the state
that holds it, through that state's ``copy_in``.

As :class:`~s3ckpt.dcp.reader.S3StorageReader` does, a fresh optimizer placed in the state
gets every saved moment (:mod:`s3ckpt.dcp.optimizer_state`), and what the load leaves out
or converts is logged once as one warning (:mod:`s3ckpt.dcp.load_report`), or raised
before a byte is loaded when ``strict``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from s3ckpt.dcp.compat import narrow
from s3ckpt.dcp.load_report import LoadReport, report_for
from s3ckpt.dcp.optimizer_state import Fills, plan_fills

CopyIn = Callable[[Sequence[tuple[torch.Tensor, torch.Tensor]]], None]
"""Copies each ``(source, target)`` pair's source into its target (same shape)."""


def copy_each(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for source, target in pairs:
        target.copy_(source)


class StateReader(StorageReader):
    """Reads the states a save's ranks held (in memory) as DCP reads that checkpoint."""

    def __init__(
        self, states: Sequence[tuple[dict[str, Any], CopyIn]], *, strict: bool = False
    ) -> None:
        """A reader of the state every rank of one save held (rank order), each with the
        ``copy_in`` its chunks are read through. ``strict``: raise
        :class:`~s3ckpt.errors.StateMismatchError` before loading when an entry would be
        left out or converted (else one warning after the load)."""
        super().__init__()
        self._strict = strict
        self._report = LoadReport("the memory tier's copy", strict)
        self._fills = Fills([])
        self._copy_ins = [copy_in for _, copy_in in states]
        self._planners = []
        plans = []
        for rank, (state, _) in enumerate(states):
            planner = DefaultSavePlanner()
            planner.set_up_planner(state, is_coordinator=rank == 0)
            plans.append(planner.create_local_plan())
            self._planners.append(planner)
        kept, self._metadata = self._planners[0].create_global_plan(plans)
        # where each item is read from: the rank whose plan kept it (replicated ones once)
        self._items = {
            item.index: (rank, item) for rank, plan in enumerate(kept) for item in plan.items
        }

    @classmethod
    def of_state(
        cls, state: dict[str, Any], copy_in: CopyIn = copy_each, *, strict: bool = False
    ) -> StateReader:
        """A reader of one rank's state (a load with the world size it was saved with)."""
        return cls([(state, copy_in)], strict=strict)

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # only ever passed as an object

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        self._report = report_for(self._report.where, self._strict)
        plan, fills = plan_fills(self._metadata, plan)  # optimizer state with no target
        self._fills = Fills(fills)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        self._report.find_dropped(self._metadata, plans)
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        report, fills = self._report, self._fills
        targets, plan = fills.planner(planner, plan)
        report.check_targets(plan, targets, self._metadata)
        self._read(plan, report.watching(targets, self._metadata))
        fills.install(planner)
        report.add_left_out(fills.left_out, self._metadata)
        report.finish()
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        _check_covered(plan, planner, self._metadata)
        copies: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = []
        by_rank: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for item in plan.items:
            index = MetadataIndex(item.storage_index.fqn, item.storage_index.offset)
            rank, write_item = self._items[index]
            data = self._planners[rank].resolve_data(write_item)
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(data.getvalue()))
                continue
            source = narrow(data, item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            copies.append((item, source, target))
            by_rank.setdefault(rank, []).append((source, target))
        for rank, pairs in sorted(by_rank.items()):
            self._copy_ins[rank](pairs)
        for item, _, target in copies:
            planner.commit_tensor(item, target)


def _check_covered(plan: LoadPlan, planner: LoadPlanner, metadata: Metadata) -> None:
    """Refuse a load that would fill only part of a tensor the state holds.

    A rank's own copy holds only the shards that rank saved; restored into a state
    sharded another way (the same world size, another layout), DCP reads the pieces that
    overlap and leaves the rest of each shard as it was, without a word. So, for every
    tensor of the target the copy has, the elements read must be all the rank holds of
    it; otherwise :class:`ValueError` (the memory tier then loads the step from S3)."""
    targets = getattr(planner, "state_dict", None)
    if not isinstance(targets, dict):
        return  # a planner that does not expose its targets: trusted
    read: dict[str, int] = {}
    for item in plan.items:
        if item.type != LoadItemType.BYTE_IO:
            fqn = item.dest_index.fqn
            read[fqn] = read.get(fqn, 0) + math.prod(item.lengths)
    for fqn, target in targets.items():
        if not isinstance(metadata.state_dict_metadata.get(fqn), TensorStorageMetadata):
            continue
        held = _local_elements(target)
        if held is not None and read.get(fqn, 0) != held:
            raise ValueError(
                f"{fqn!r}: the copy holds {read.get(fqn, 0)} of the {held} elements this "
                "rank's state needs (sharded differently when it was saved)"
            )


def _local_elements(target: Any) -> int | None:
    """Elements of ``target`` this rank holds (a DTensor's local shard, a ShardedTensor's
    local shards, a tensor), None for anything else."""
    if hasattr(target, "to_local"):
        return target.to_local().numel()
    if hasattr(target, "local_shards"):
        return sum(shard.tensor.numel() for shard in target.local_shards())
    if isinstance(target, torch.Tensor):
        return target.numel()
    return None
