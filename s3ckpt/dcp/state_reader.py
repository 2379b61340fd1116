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
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from s3ckpt.dcp.compat import narrow

CopyIn = Callable[[Sequence[tuple[torch.Tensor, torch.Tensor]]], None]
"""Copies each ``(source, target)`` pair's source into its target (same shape)."""


def copy_each(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for source, target in pairs:
        target.copy_(source)


class StateReader(StorageReader):
    """Reads ``state`` (one rank's saved state, in memory) as DCP reads a checkpoint."""

    def __init__(self, state: dict[str, Any], copy_in: CopyIn = copy_each) -> None:
        super().__init__()
        self._copy_in = copy_in
        self._planner = DefaultSavePlanner()
        self._planner.set_up_planner(state, is_coordinator=True)
        plan = self._planner.create_local_plan()
        _, self._metadata = self._planner.create_global_plan([plan])
        self._items = {item.index: item for item in plan.items}

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
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        copies = []
        for item in plan.items:
            index = MetadataIndex(item.storage_index.fqn, item.storage_index.offset)
            data = self._planner.resolve_data(self._items[index])
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(data.getvalue()))
                continue
            source = narrow(data, item.storage_offsets, item.lengths)
            copies.append((item, source, planner.resolve_tensor(item).detach()))
        self._copy_in([(source, target) for _, source, target in copies])
        for item, _, target in copies:
            planner.commit_tensor(item, target)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done
