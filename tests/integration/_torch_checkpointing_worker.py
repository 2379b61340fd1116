"""Rank side of the torch-checkpointing test on two gloo ranks (started by
``_dist_worker.run_ranks``): each rank saves its own state through torch-checkpointing's
asynchronous manager, rank 0 commits, and each rank loads its state back."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _dist_worker import _init, _report


def rank_state(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 + rank)
    return {"model": {"w": torch.randn(3 * 1024 * 1024, generator=g)}, "step": 7}


def two_ranks_main(rank: int, world_size: int, port: int, s3: dict[str, Any], uri: str, out: str):
    from torch_checkpointing import CheckpointManager

    from s3ckpt import catalog
    from s3ckpt.integrations.torch_checkpointing import manager_config

    _init(rank, world_size, port)
    report: dict[str, Any] = {}
    try:
        manager = CheckpointManager(manager_config(uri, **s3))
        try:
            manager.save(f"{uri}/step-7", rank_state(rank)).result(timeout=240)
            dist.barrier()  # rank 0's commit is part of its own save
            into = {"model": {"w": torch.zeros(3 * 1024 * 1024)}, "step": 0}
            report["loaded"] = manager.load(f"{uri}/step-7", into=into)
        finally:
            manager.close()
        [info] = catalog.list_checkpoints(uri, details=True, **s3)
        report["listed"] = (info.name, info.committed, info.ranks, info.items)
    finally:
        _report(out, rank, report)
        dist.destroy_process_group()
