"""A save's local plan, made once and reused while the state keeps its layout.

DCP's default planner describes every tensor anew at each save, and its description asks
``tensor.is_pinned()``, a torch call that releases the GIL and takes it back. In thread
mode that runs on a thread beside the training loop, which then has to hand the GIL over
once per tensor, plus the planning's own Python (docs/decisions/0008-thread-mode-gil.md).
A training loop saves the same layout again and again, so :class:`ReusingSavePlanner`
keeps the local plan it made and hands it out again while every value keeps its kind,
dtype, shape, strides, layout, ``requires_grad``, device and memory address, all read as
attributes that release nothing. The address stands for whether the memory is pinned (it is the same
allocation), which is all ``is_pinned`` tells.

The coordinator's global plan (deduplication across ranks, the metadata, DCP's validation
of every chunk's bounds) is a function of the ranks' local plans alone, and DCP makes it
again at each save, milliseconds of Python on the save's thread beside the loop in thread
mode. When every rank's local plan equals the previous save's, the global plan and a fresh
copy of its metadata are handed out again, at a fraction of that cost; plans gathered
from other ranks are compared as values.

Everything else is DCP's :class:`DefaultSavePlanner`, as are the plans of states holding
sharded tensors (``DTensor``, ``ShardedTensor``, DCP's ``_Checkpointable``), whose items
depend on more than their local attributes, every plan of a planner with DCP's own
``enable_plan_caching``, and every plan made where the engine shares no interpreter with a
training loop (the checkpoint process: :func:`~s3ckpt.transfer.thread_mode.gil_tuned`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from s3ckpt.dcp.compat import (
    Metadata,
    SavePlan,
    WriteItem,
    WriteItemType,
    is_sharded_tensor,
    plans_cached_by_dcp,
)
from s3ckpt.transfer.thread_mode import gil_tuned


class ReusingSavePlanner(DefaultSavePlanner):
    """:class:`DefaultSavePlanner` whose local plan is reused from the previous save of
    the same layout. Plans exactly what the default planner plans; one instance serves
    one save at a time (DCP calls ``set_up_planner`` at each save)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._layout: tuple[Hashable, ...] | None = None
        self._made: SavePlan | None = None  # the local plan made for that layout
        # The ranks' local plans of the last global plan, and what it returned.
        self._global: tuple[list[SavePlan], list[SavePlan], Metadata] | None = None
        # A subclass that resolves items its own way (DCP's extension points) is asked.
        self._reads_state_dict = all(
            getattr(type(self), name) is getattr(DefaultSavePlanner, name)
            for name in ("lookup_object", "transform_object")
        )

    def let_go(self) -> None:
        """Drop the last save's state dict (the plan stays): its tensors are freed on the
        calling thread, and a mapping under them can be closed."""
        self.state_dict = {}

    def create_local_plan(self) -> SavePlan:
        # DCP's own plan caching (``enable_plan_caching``) decides what its local plan
        # says; such a planner plans as the default does.
        reused = gil_tuned() and not plans_cached_by_dcp(self)
        layout = state_layout(self.state_dict) if reused else None
        if layout is None or layout != self._layout or self._made is None:
            self._made = super().create_local_plan()
            self._layout = layout
            return self._made
        plan = SavePlan(list(self._made.items))
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        """The item's value: a plain tensor's read straight from the state dict, where
        DCP's lookup (``find_state_dict_object``) spends microseconds an item on the
        thread beside the loop (an ``hasattr`` miss, ``isinstance`` checks, a
        ``torch.Size`` of zeros built to compare the offset;
        docs/decisions/0008-thread-mode-gil.md); anything else (bytes, sharded tensors,
        DCP's ``_Checkpointable``, an offset that is not the origin, which DCP refuses)
        as the default planner resolves it, and every item of a subclass that overrides
        ``lookup_object`` or ``transform_object``."""
        index = write_item.index
        value = self.state_dict.get(index.fqn)
        if (
            self._reads_state_dict
            and gil_tuned()
            and type(value) in _PLAIN_TENSORS
            and write_item.type != WriteItemType.BYTE_IO
            and not any(index.offset or ())
        ):
            return value
        return super().resolve_data(write_item)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """The previous global plan again while ``all_plans`` equal the previous ones.

        A planner with DCP's own plan caching gets DCP's: that caching also decides what
        the ranks' plans say, which this one takes as given. The ranks' plans are kept
        (on the coordinator only, which alone plans globally) to compare with the next
        save's: O(items) of memory and one comparison per save, against the planning's
        O(items x ranks)."""
        if plans_cached_by_dcp(self) or not gil_tuned():
            return super().create_global_plan(all_plans)
        if self._global is not None and self._global[0] == all_plans:
            global_plan, metadata = list(self._global[1]), _fresh(self._global[2])
            self.global_plan, self.metadata = global_plan, metadata
            return global_plan, metadata
        global_plan, metadata = super().create_global_plan(all_plans)
        # A planner that records this save's storage_meta in the metadata plans anew.
        reusable = metadata.storage_meta is None
        self._global = (list(all_plans), list(global_plan), _fresh(metadata)) if reusable else None
        return global_plan, metadata


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _fresh(metadata: Metadata) -> Metadata:
    """A copy of ``metadata`` for one save: the fields a save sets (the storage's record)
    and the mappings it may extend (the entries, the planner's mappings) are its own; the
    entries' objects (``TensorStorageMetadata``, chunks, properties) are shared with every
    other save of the plan, as DCP shares them with the plan's items: nothing changes
    them after planning."""
    return dataclasses.replace(
        metadata,
        state_dict_metadata=dict(metadata.state_dict_metadata),
        planner_data=_copied(metadata.planner_data),
        storage_data=None,
    )


def _copied(value: Any) -> Any:
    """A mapping copied (the planner's mappings, a dict), anything else as it is."""
    return dict(value) if isinstance(value, dict) else value


def state_layout(state_dict: dict[str, Any]) -> tuple[Hashable, ...] | None:
    """What the default local plan of ``state_dict`` depends on, per value; None when it
    holds a sharded tensor (planned at every save)."""
    layout: list[Hashable] = []
    for fqn, value in state_dict.items():
        if type(value) in _PLAIN_TENSORS:
            layout.append((
                fqn, value.dtype, value.layout, value.requires_grad, value.device,
                tuple(value.shape), value.data_ptr() if value.layout == torch.strided else 0,
                # Strides: in the plan's tensor properties from torch 2.15 on.
                tuple(value.stride()) if value.layout == torch.strided else (),
            ))  # fmt: skip
        elif isinstance(value, torch.Tensor) or is_sharded_tensor(value):
            return None
        else:
            layout.append((fqn, None))
    return tuple(layout)
