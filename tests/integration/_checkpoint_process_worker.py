"""Rank side of the checkpoint-process tests on several gloo ranks (started by
``_dist_worker.run_ranks``): sharded DTensor state saved by the checkpoint processes and
loaded back, and a checkpoint process killed in the middle of a save or while the
processes meet."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist_worker import _init, _report, dtensor_full_state
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def sharded_state(mesh: Any) -> dict[str, Any]:
    full = dtensor_full_state()
    return {
        "model": {name: distribute_tensor(t, mesh, [Shard(0)]) for name, t in full.items()},
        "plain": torch.arange(10, dtype=torch.float64),  # replicated: the same on every rank
        "step": 3,
    }


def dtensor_main(rank: int, world_size: int, port: int, s3: dict[str, Any], uri: str, out: str):
    """A manager in its default mode saves DTensors twice (the second into the same
    staging memory, by the same process), then loads them into a fresh sharded state."""
    from s3ckpt import CheckpointManager

    _init(rank, world_size, port)
    report: dict[str, Any] = {}
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        state = sharded_state(mesh)
        with CheckpointManager(uri, **s3) as manager:
            process = manager._saves.process
            report["pid"] = process.pid
            manager.save(1, state)
            manager.wait()
            report["staging_after_first"] = process.staging_bytes
            segments = list(process.arena().segments)
            for tensor in state["model"].values():
                tensor.to_local().mul_(2)
            manager.save(2, state)
            manager.wait()
            report["same_segments"] = process.arena().segments == segments
            report["same_pid"] = process.pid == report["pid"]
            report["steps"] = manager.steps()
            fresh = sharded_state(mesh)
            for tensor in fresh["model"].values():
                tensor.to_local().zero_()
            fresh["plain"].zero_()
            report["loaded_step"] = manager.load_latest(fresh)
            report["loaded"] = {k: v.full_tensor() for k, v in fresh["model"].items()}
            report["plain"] = fresh["plain"]
        # the same checkpoint, loaded as plain tensors: the metadata is DTensor's own
        plain = {"model": {k: torch.zeros_like(v) for k, v in dtensor_full_state().items()}}
        dcp.load(plain, checkpoint_id=None, storage_reader=_reader(f"{uri}/step-0000000002", s3))
        report["full"] = plain["model"]
        report["pid_gone"] = not os.path.exists(f"/proc/{report['pid']}")
    finally:
        _report(out, rank, report)
        dist.destroy_process_group()


def killed_main(rank: int, world_size: int, port: int, s3: dict[str, Any], uri: str, out: str):
    """Rank 1's checkpoint process is killed once its objects are written: the save fails
    on both ranks, nothing is committed, and the next save commits with fresh processes."""
    from _process_writers import HeldAfterUpload

    from s3ckpt import CheckpointProcess, S3StorageWriter

    _init(rank, world_size, port)
    report: dict[str, Any] = {}
    try:
        process = CheckpointProcess()
        state = {f"w{rank}": torch.randn(1024, 1024)}
        marker = Path(out) / f"marker{rank}"
        writer = (
            HeldAfterUpload(f"{uri}/a", str(marker), **s3)
            if rank == 1
            else S3StorageWriter(f"{uri}/a", **s3)
        )
        first_pid = process.pid
        future = process.async_save(state, storage_writer=writer)
        if rank == 1:
            deadline = time.monotonic() + 120
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(first_pid, signal.SIGKILL)
        _after_the_kill(report, process, future, first_pid, state, uri, s3, timeout=120)
    finally:
        _report(out, rank, report)
        dist.destroy_process_group()


def killed_meeting_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], uri: str, out: str
):
    """Rank 1's checkpoint process is killed while the processes are still meeting (it is
    importing torch: the group cannot have formed): rank 0's process, which would wait in
    ``init_process_group`` for the collective timeout, is stopped by its trainer, both
    saves fail naming rank 1, and the next save commits with fresh processes."""
    from s3ckpt import CheckpointProcess, S3StorageWriter

    _init(rank, world_size, port)
    report: dict[str, Any] = {}
    try:
        process = CheckpointProcess(timeout_s=900)  # a hang outlasts the test's timeout
        state = {f"w{rank}": torch.randn(256, 1024)}
        first_pid = process.pid
        future = process.async_save(state, storage_writer=S3StorageWriter(f"{uri}/a", **s3))
        if rank == 1:
            os.kill(first_pid, signal.SIGKILL)
        _after_the_kill(report, process, future, first_pid, state, uri, s3, timeout=240)
    finally:
        _report(out, rank, report)
        dist.destroy_process_group()


def _after_the_kill(
    report: dict[str, Any], process: Any, future: Any, first_pid: int | None,
    state: dict[str, Any], uri: str, s3: dict[str, Any], *, timeout: float,
) -> None:  # fmt: skip
    """How the save a kill hit ended, then a second save (into ``<uri>/b``) on fresh
    processes, and what the catalog lists after them."""
    from s3ckpt import CheckpointError, S3StorageWriter, catalog

    try:
        future.result(timeout=timeout)
        report["first"] = "committed"
    except CheckpointError as exc:
        report["first"] = f"{type(exc).__name__}: {exc}"
    future = process.async_save(state, storage_writer=S3StorageWriter(f"{uri}/b", **s3))
    report["second_metadata"] = type(future.result(timeout=timeout)).__name__
    report["fresh_pid"] = process.pid != first_pid
    process.close()
    listed = catalog.list_checkpoints(uri, include_uncommitted=True, **s3)
    report["listed"] = sorted((i.name, i.committed) for i in listed)


def _reader(uri: str, s3: dict[str, Any]) -> Any:
    from s3ckpt import S3StorageReader

    return S3StorageReader(uri, **s3)
