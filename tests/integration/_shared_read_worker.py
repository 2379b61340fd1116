"""Rank side of the shared-read tests: load a checkpoint of full tensors as DDP (every rank
a full copy) or HSDP (a 2 x 2 mesh: replicated over the first dimension, sharded over the
second), with or without the reader given the group, through the parent's proxy."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _dist_worker import _init, _report

MiB = 1024 * 1024


def full_state() -> dict[str, torch.Tensor]:
    """Two tensors over a checksum block each (so HSDP's shards are distinct ranges), and
    small ones of several dtypes."""
    g = torch.Generator().manual_seed(11)
    return {
        "big": torch.randn(64, 64 * 1024, generator=g),  # 16 MiB
        "wide": torch.randn(32, 128 * 1024, generator=g).to(torch.bfloat16),  # 8 MiB
        "small": torch.randn(100, 7, generator=g),
        "ids": torch.arange(5000, dtype=torch.int64),
    }


def stored_bytes() -> int:
    return sum(t.numel() * t.element_size() for t in full_state().values())


def _fail_fetches(rank: int) -> None:
    """This rank's ranged GETs fail, as a store refusing it would."""
    from s3ckpt.errors import StorageError
    from s3ckpt.transfer.download import Downloader

    def refuse(self: Any, targets: Any, idle: Any = None) -> Any:
        raise StorageError(f"injected: rank {rank} cannot read its share")
        yield  # a generator, like the real one

    Downloader.fetch = refuse  # type: ignore[method-assign]


def shared_load_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], uri: str, out_dir: str,
    layout: str, shared: bool, failing_rank: int | None = None,
) -> None:  # fmt: skip
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from s3ckpt import S3StorageReader

    _init(rank, world_size, port)
    try:
        full = full_state()
        if layout == "partial":  # some keys only
            full = {k: full[k] for k in ("wide", "ids")}
        if layout in ("ddp", "partial"):
            target: dict[str, Any] = {k: torch.full_like(v, -1) for k, v in full.items()}
        else:
            mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "fsdp"))
            target = {
                k: distribute_tensor(torch.full_like(v, -1), mesh, [Replicate(), Shard(0)])
                for k, v in full.items()
            }
        reader = S3StorageReader(uri, process_group=dist.group.WORLD if shared else None, **s3)
        if rank == failing_rank:
            _fail_fetches(rank)
        try:
            dcp.load(target, storage_reader=reader)
        except BaseException as exc:
            from s3ckpt import unwrap

            error = unwrap(exc)
            _report(out_dir, rank, {"error": f"{type(error).__name__}: {error}"})
            return
        exact = {}
        for key, value in target.items():
            if layout in ("ddp", "partial"):
                exact[key] = torch.equal(value, full[key])
            else:
                expected = distribute_tensor(full[key], value.device_mesh, value.placements)
                exact[key] = torch.equal(value.to_local(), expected.to_local())
        _report(out_dir, rank, {"exact": exact})
    finally:
        dist.destroy_process_group()


def legacy_load_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], uri: str, out_dir: str,
    expected_path: str,
) -> None:  # fmt: skip
    """Every rank loads a format-1 checkpoint (items in the manifest) with the group."""
    import io

    import torch.distributed.checkpoint as dcp

    from s3ckpt import S3StorageReader

    _init(rank, world_size, port)
    try:
        expected = torch.load(expected_path, weights_only=True)
        model = {name: torch.zeros_like(t) for name, t in expected["model"].items()}
        state = {"model": model, "extra": {"epoch": 0, "name": "", "history": io.BytesIO()}}
        dcp.load(state, storage_reader=S3StorageReader(uri, process_group=dist.group.WORLD, **s3))
        exact = {n: torch.equal(model[n], t) for n, t in expected["model"].items()}
        exact["extra"] = state["extra"]["epoch"] == expected["extra"]["epoch"]
        _report(out_dir, rank, {"exact": exact})
    finally:
        dist.destroy_process_group()
