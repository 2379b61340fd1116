"""Rank side of the overwrite-during-load tests: ranks load a sharded checkpoint in rounds
while the parent test overwrites it and collects the replaced save with no grace."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _dist_worker import _init, _report

SHAPES = {"w": (64, 48), "b": (37, 5)}


def version_state(version: int) -> dict[str, torch.Tensor]:
    """The full tensors of save ``version``: every element holds the version's number."""
    return {k: torch.full(shape, float(version)) for k, shape in SHAPES.items()}


def _stall_first_fetch(signals: Path, round_: int) -> None:
    """Hold this rank's first data fetch of the round until the parent has overwritten the
    checkpoint and collected the replaced save."""
    from s3ckpt.transfer.download import Downloader

    original = Downloader.fetch

    def fetch(self: Any, targets: Any, idle: Any = None) -> Any:
        Downloader.fetch = original  # type: ignore[method-assign]
        (signals / f"stalled-{round_}").touch()
        deadline = time.monotonic() + 90
        while not (signals / f"overwritten-{round_}").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"round {round_}: the parent never overwrote")
            time.sleep(0.05)
        return original(self, targets, idle)

    Downloader.fetch = fetch  # type: ignore[method-assign]


def loading_main(
    rank: int,
    world_size: int,
    port: int,
    s3: dict[str, Any],
    uri: str,
    out_dir: str,
    rounds: int,
    forced: list[int],
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from s3ckpt import CheckpointReplacedError, S3StorageReader, unwrap

    _init(rank, world_size, port)
    outcomes: list[tuple[str, Any]] = []
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        for round_ in range(rounds):
            target = {
                k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in version_state(-1).items()
            }
            group = dist.group.WORLD if round_ % 2 else None  # shared metadata read, or not
            reader = S3StorageReader(uri, process_group=group, **s3)
            if round_ in forced and rank == world_size - 1:
                _stall_first_fetch(Path(out_dir), round_)
            try:
                dcp.load(target, storage_reader=reader)
            except BaseException as exc:
                error = unwrap(exc)
                if not isinstance(error, CheckpointReplacedError):
                    raise
                outcomes.append(("replaced", str(error)))
            else:
                values = {float(v.to_local().unique().max()) for v in target.values()}
                values |= {float(v.to_local().unique().min()) for v in target.values()}
                outcomes.append(("loaded", sorted(values)))
            dist.barrier()
        _report(out_dir, rank, {"outcomes": outcomes})
    finally:
        dist.destroy_process_group()
