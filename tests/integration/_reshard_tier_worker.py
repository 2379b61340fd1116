"""Rank side of the memory tier's resharding restores (started by
``_dist_worker.run_ranks``): a job saves DTensor-sharded state on some ranks, and a job
with another world size restores it from the node's copies."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _dist_worker import _init, _report
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

ROWS = 12  # divides among 1, 2, 3, 4 and 6 ranks


def full_state(step: int) -> dict[str, Any]:
    """What every step's state holds, in full: two row-sharded tensors (each shard of
    ``w`` over 1 MiB on up to two ranks), a replicated one, and a plain value."""
    base = torch.arange(ROWS * 65536, dtype=torch.float32).reshape(ROWS, 65536)
    return {
        "w": base + step,
        "b": torch.arange(ROWS, dtype=torch.float64) * step,
        "emb": torch.full((256, 1024), float(step)),  # 1 MiB, the same on every rank
        "extra": {"epoch": step, "name": f"step {step}"},
    }


def sharded(state: dict[str, Any], mesh: Any, dim: int = 0) -> dict[str, Any]:
    """``w`` sharded by rows (``dim`` 0) or columns (1), ``b`` by rows."""
    out = dict(state)
    out["w"] = distribute_tensor(state["w"], mesh, [Shard(dim)])
    out["b"] = distribute_tensor(state["b"], mesh, [Shard(0)])
    return out


def zeroed(step: int) -> dict[str, Any]:
    """A state of the same layout, different values (what a fresh job starts from)."""
    state = {k: v.clone().zero_() if torch.is_tensor(v) else v for k, v in full_state(step).items()}
    state["extra"] = {"epoch": -1, "name": ""}
    return state


def gathered(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}


def save_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], uri: str, out: str, root: str,
    s3_every: int = 2,
) -> None:  # fmt: skip
    """Save steps 2 and 3 sharded over the ranks (S3 every ``s3_every``-th step)."""
    from s3ckpt import CheckpointManager, MemoryTier

    _init(rank, world_size, port)
    report: dict[str, Any] = {}
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        tier = MemoryTier(keep=2, s3_every=s3_every, root=root)
        with CheckpointManager(uri, memory_tier=tier, **s3) as manager:
            for step in (2, 3):
                manager.save(step, sharded(full_state(step), mesh))
                manager.wait()
            report["held"] = manager.held_steps()
            report["s3"] = manager.steps()
    finally:
        _report(out, rank, report)
        dist.destroy_process_group()


def restore_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], uri: str, out: str, root: str,
    dim: int = 0, s3_every: int = 2,
) -> None:  # fmt: skip
    """Restore into a fresh state sharded over this job's ranks (``w`` along ``dim``);
    what came back, whole."""
    from s3ckpt import CheckpointManager, MemoryTier

    _init(rank, world_size, port)
    report: dict[str, Any] = {}
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        state = sharded(zeroed(0), mesh, dim)
        tier = MemoryTier(keep=2, s3_every=s3_every, root=root)
        with CheckpointManager(uri, memory_tier=tier, **s3) as manager:
            report["step"] = manager.load_latest(state)
            restored = manager.last_restore
            report["tier"] = None if restored is None else restored.tier
        report["state"] = gathered(state)
    finally:
        _report(out, rank, report)
        dist.destroy_process_group()
