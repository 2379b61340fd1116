"""Sharded tensors (``DTensor``, ``ShardedTensor``, DCP's ``_Checkpointable``): their write
items and local shards, and a ``DTensor``'s layout, taken apart and made again."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem


def shard_write_items(obj: Any) -> list[tuple[WriteItem, torch.Tensor]]:
    """The write items DCP's default planner makes for a sharded tensor (a ``DTensor``, a
    ``ShardedTensor``, any object with DCP's ``__create_write_items__``), each with the
    local tensor that holds its bytes; the items' FQN is left empty, for the planner to
    fill in. A ``DTensor`` whose mesh leaves this rank out has none, as in DCP's
    ``create_default_local_save_plan``. Uses DCP's private ``_create_write_items``.
    """
    from torch.distributed.checkpoint.planner_helpers import _create_write_items
    from torch.distributed.checkpoint.utils import find_tensor_shard
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
        return []
    return [(item, find_tensor_shard(obj, item.index)) for item in _create_write_items("", obj)]


def is_sharded_tensor(obj: Any) -> bool:
    """Whether DCP saves ``obj`` as shards with their own offsets (``DTensor``,
    ``ShardedTensor``, or an object of DCP's ``_Checkpointable`` protocol)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(obj, ShardedTensor) or hasattr(obj, "__create_write_items__")


def dtensor_spec_of(tensor: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """A ``DTensor``'s mesh and placements; None for anything else."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return None
    return tensor.device_mesh, tuple(tensor.placements)


def as_dtensor(local: torch.Tensor, spec: tuple[Any, tuple[Any, ...]], shape: Sequence[int]) -> Any:
    """``local`` (this rank's shard of a tensor of global ``shape``) as a ``DTensor`` with
    the mesh and placements of ``spec``, no collective."""
    from torch.distributed.tensor import DTensor

    mesh, placements = spec
    stride = torch.empty(tuple(shape), device="meta").stride()
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def local_chunk_of(
    shape: Sequence[int], spec: tuple[Any, tuple[Any, ...]]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Offsets and sizes of this rank's shard of a ``DTensor`` of global ``shape`` laid out
    as ``spec`` (DTensor's private ``compute_local_shape_and_global_offset``); None when
    this rank is outside the mesh."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = spec
    if mesh.get_coordinate() is None:
        return None
    sizes, offsets = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    return tuple(offsets), tuple(sizes)
