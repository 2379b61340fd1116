"""``StagedShards``: a sharded tensor's staged bytes, saved by a process that has no mesh.

A ``DTensor`` (or ``ShardedTensor``) needs its device mesh and process groups to say where
its local shard lies in the global tensor, and the checkpoint process has neither. So the
trainer asks DCP once, while staging, for the write items the tensor makes (offsets,
sizes, global shape, properties), and the checkpoint process saves a ``StagedShards`` that
answers DCP's ``_Checkpointable`` protocol with those same items over the staged bytes:
the checkpoint's metadata is exactly the one the ``DTensor`` itself would have written,
and loads into ``DTensor``s (any sharding) as usual.

It is a ``torch.Tensor`` (over its first shard) only because DCP looks its shards up
through ``find_tensor_shard`` for tensors alone; torch functions see a plain tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from s3ckpt.dcp.compat import (
    MetadataIndex,
    WriteItem,
    disabled_torch_function,
    tensor_subclass_of,
)


class StagedShards(torch.Tensor):
    """The staged shards of one sharded tensor, with the write items DCP made for them."""

    __torch_function__ = disabled_torch_function

    _s3ckpt_items: list[WriteItem]
    _s3ckpt_shards: list[torch.Tensor]

    @staticmethod
    def of(items: list[WriteItem], shards: list[torch.Tensor]) -> StagedShards:
        base = shards[0] if shards else torch.empty(0)
        staged = tensor_subclass_of(StagedShards, base.detach())
        staged._s3ckpt_items = items
        staged._s3ckpt_shards = shards
        return staged

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            dataclasses.replace(item, index=dataclasses.replace(item.index, fqn=fqn))
            for item in self._s3ckpt_items
        ]

    def __create_chunk_list__(self) -> list[Any]:
        return [item.tensor_data.chunk for item in self._s3ckpt_items if item.tensor_data]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for item, shard in zip(self._s3ckpt_items, self._s3ckpt_shards, strict=True):
            if item.index.offset == index.offset:
                return shard
        raise ValueError(f"no staged shard of {index.fqn!r} at offset {index.offset}")
