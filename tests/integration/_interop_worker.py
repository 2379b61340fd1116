"""A checkpoint saved by two gloo ranks, tensors sharded across them, for the
export tests (:mod:`test_interop`). Runs in processes started by ``run_ranks``, so it
lives here."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _dist_worker import _init


def sharded_state() -> dict[str, torch.Tensor]:
    """The full tensors the ranks save, sharded: by rows, by columns, or replicated."""
    g = torch.Generator().manual_seed(11)
    return {
        "model.embed.weight": torch.randn(37, 16, generator=g),  # Shard(0), uneven
        "model.layers.0.proj.weight": torch.randn(24, 40, generator=g).to(torch.bfloat16),
        "model.layers.0.norm.weight": torch.rand(40, generator=g).to(torch.float16),
        "model.head.weight": torch.randn(16, 37, generator=g),  # Shard(1), uneven
        "optim.count": torch.arange(12, dtype=torch.int64),  # replicated
    }


SHARDING = {
    "model.embed.weight": 0,
    "model.layers.0.proj.weight": 0,
    "model.layers.0.norm.weight": 0,
    "model.head.weight": 1,
}


def save_sharded_main(rank: int, world_size: int, port: int, s3: dict[str, Any], uri: str) -> None:
    """Save :func:`sharded_state` as DTensors over ``world_size`` ranks, plus a step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from s3ckpt import S3StorageWriter

    _init(rank, world_size, port)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        state: dict[str, Any] = {
            name: distribute_tensor(
                tensor, mesh, [Shard(SHARDING[name]) if name in SHARDING else Replicate()]
            )
            for name, tensor in sharded_state().items()
        }
        state["step"] = 1234
        dcp.save(state, storage_writer=S3StorageWriter(uri, **s3))
        dist.barrier()
    finally:
        dist.destroy_process_group()
