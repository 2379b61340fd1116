"""Rank side of the plan-caching tests: DCP's ``DefaultSavePlanner(enable_plan_caching=True)``
on 2 gloo ranks, saving a DTensor state whose values name the save they belong to."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _dist_worker import _init, _report, _writer, dtensor_full_state

SHAPES = {k: tuple(v.shape) for k, v in dtensor_full_state().items()}


def version_state(version: int) -> dict[str, torch.Tensor]:
    """The full tensors of save ``version``: every element holds the version's number."""
    full = dtensor_full_state()
    return {k: torch.full_like(v, float(version)) for k, v in full.items()}


def committed_version(uri: str, s3: dict[str, Any]) -> float | None:
    """The version the checkpoint at ``uri`` holds now (loaded in this process alone), or
    ``None`` when nothing is committed there."""
    import torch.distributed.checkpoint as dcp

    from s3ckpt import CheckpointNotFoundError, S3StorageReader, unwrap

    state = {k: torch.full(shape, -1.0) for k, shape in SHAPES.items()}
    try:
        dcp.load(state, storage_reader=S3StorageReader(uri, **s3), no_dist=True)
    except BaseException as exc:
        if isinstance(unwrap(exc), CheckpointNotFoundError):
            return None
        raise
    values = {float(v.float().unique().item()) for v in state.values() if v.unique().numel() == 1}
    assert len(values) == 1, f"{uri} holds a mix of saves: {values}"
    return values.pop()


def _checking_writer(uri: str, s3: dict[str, Any], seen: list[float | None]) -> Any:
    """A writer whose coordinator loads what is committed at ``uri`` just before it commits
    (every rank's objects are written by then)."""
    from s3ckpt import S3StorageWriter

    class CheckingWriter(S3StorageWriter):
        def finish(self, metadata: Any, results: Any) -> None:
            seen.append(committed_version(uri, s3))
            super().finish(metadata, results)

    return CheckingWriter(uri, overwrite=True, **s3)


def plan_caching_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], base: str, out_dir: str
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    _init(rank, world_size, port)
    try:
        mesh = init_device_mesh("cpu", (world_size,))

        def state(version: int) -> dict[str, Any]:
            return {
                k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in version_state(version).items()
            }

        def save(version: int, writer: Any) -> None:
            planner = DefaultSavePlanner(enable_plan_caching=True)
            dcp.save(state(version), storage_writer=writer, planner=planner)

        def load(uri: str) -> dict[str, torch.Tensor]:
            target = state(-1)
            dcp.load(target, storage_reader=_reader(uri, s3))
            return {k: v.to_local().clone() for k, v in target.items()}

        loaded_new = {}
        for version in (1, 2, 3):  # new ids: the second and third replay the cached plan
            uri = f"{base}/new-{version}"
            save(version, _writer(uri, s3))
            loaded_new[version] = load(uri)
        seen_before_commit: list[float | None] = []
        for version in (10, 11, 12):  # one id, saved over twice
            save(version, _checking_writer(f"{base}/over", s3, seen_before_commit))
        dist.barrier()
        _report(
            out_dir,
            rank,
            {
                "loaded_new": loaded_new,
                "loaded_over": load(f"{base}/over"),
                "seen_before_commit": seen_before_commit,
            },
        )
    finally:
        dist.destroy_process_group()


def _reader(uri: str, s3: dict[str, Any]) -> Any:
    from s3ckpt import S3StorageReader

    return S3StorageReader(uri, **s3)
