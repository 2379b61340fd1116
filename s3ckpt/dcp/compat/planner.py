"""What DCP's default planners keep and make beyond the planner API: plan caching, the
targets of a load, read items for a local chunk, and the shape of every stored chunk."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem


def plans_cached_by_dcp(planner: Any) -> bool:
    """Whether ``planner`` was made with DCP's own ``enable_plan_caching`` (its private
    ``_enable_plan_caching``; False on releases without it)."""
    return bool(getattr(planner, "_enable_plan_caching", False))


def chunk_shapes(metadata: Metadata) -> dict[MetadataIndex, tuple[torch.dtype, torch.Size]]:
    """dtype and stored shape of every tensor chunk, keyed like ``storage_data``."""
    shapes: dict[MetadataIndex, tuple[torch.dtype, torch.Size]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for index, chunk in enumerate(md.chunks):
                key = MetadataIndex(fqn, chunk.offsets, index)
                shapes[key] = (md.properties.dtype, chunk.sizes)
    return shapes


def load_targets(planner: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]] | None:
    """What a load planner loads into: the state dict handed to ``dcp.load`` (after
    ``Stateful`` objects gave their ``state_dict()``), its flattened view (FQN -> target)
    and the path of every flattened FQN in the former; None for a planner that does not
    keep them. DCP's ``DefaultLoadPlanner`` keeps them as ``original_state_dict``,
    ``state_dict`` and ``mappings`` (attributes of the class, not of the planner API)."""
    original = getattr(planner, "original_state_dict", None)
    flat = getattr(planner, "state_dict", None)
    mappings = getattr(planner, "mappings", None)
    if not getattr(planner, "flatten_state_dict", False):
        return None
    if not isinstance(original, dict) or not isinstance(flat, dict):
        return None
    if not isinstance(mappings, dict):
        return None
    return original, flat, mappings


def read_items_for(
    fqn: str, md: Any, offsets: Sequence[int], sizes: Sequence[int]
) -> list[ReadItem]:
    """DCP's read items that fill a local chunk (``offsets``/``sizes`` in the stored
    tensor ``fqn``) from the chunks stored, or read a non-tensor entry whole (DCP's
    ``create_read_items_for_chunk_list``, and its private ``_create_read_items`` for
    bytes)."""
    from torch.distributed.checkpoint.planner_helpers import (
        _create_read_items,
        create_read_items_for_chunk_list,
    )

    if isinstance(md, BytesStorageMetadata):
        return _create_read_items(fqn, md, None)
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    return create_read_items_for_chunk_list(fqn, md, [chunk])
