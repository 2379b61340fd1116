"""Helpers for the multi-process tests: deterministic states, rank entry points, a launcher.

The rank entry points run in processes forked from a forkserver that has imported torch,
DCP and s3ckpt once (a rank starts in milliseconds, not seconds of CPU), in the parent's
environment as of their start, so they live in this importable module (not in a test
file) and receive everything they need as arguments: the S3 endpoint and credentials,
the checkpoint locations, and a directory where each rank leaves a report
(``torch.save``) for the parent test to check. The parent computes its expectations from
the same deterministic state builders.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

# What the forkserver the ranks fork from imports once per test process, so that a rank
# starts with torch, DCP and s3ckpt loaded instead of importing them (seconds of CPU each).
RANK_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "s3ckpt"]

# Tensor-parallel shards of the DTensor checkpoint, by key, when loaded on four ranks.
RESHARD_DIMS = {"w": 0, "e": 1, "odd": 0, "odd2": 1}


# -- deterministic states (used by ranks and by the parent) ---------------------------------


def replicated_tensor() -> torch.Tensor:
    return torch.linspace(-3.0, 3.0, 33, dtype=torch.float64)


def per_rank_state(rank: int, world_size: int) -> dict[str, Any]:
    """What rank ``rank`` saves: its own tensors (distinct shapes and dtypes), one shared tensor."""
    g = torch.Generator().manual_seed(1000 + rank)
    return {
        f"rank{rank}.weight": torch.randn(8 + rank, 16, generator=g),
        f"rank{rank}.ids": torch.arange(rank * 100, rank * 100 + 50, dtype=torch.int64),
        f"rank{rank}.half": torch.randn(4, 3 + rank, generator=g).to(torch.float16),
        f"rank{rank}.note": f"rank {rank} of {world_size}",
        "replicated": replicated_tensor(),
    }


def empty_like_state(state: dict[str, Any]) -> dict[str, Any]:
    """A load target for ``state``: tensors of the same shape and dtype filled with garbage."""
    return {
        k: torch.full_like(v, 7) if isinstance(v, torch.Tensor) else None for k, v in state.items()
    }


def dtensor_full_state() -> dict[str, torch.Tensor]:
    """The full (unsharded) tensors of the DTensor checkpoint."""
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(64, 48, generator=g),
        "e": torch.randn(24, 40, generator=g).to(torch.bfloat16),
        "odd": torch.randn(37, 5, generator=g),  # 37 rows: not divisible by 2 or 4
        "odd2": torch.arange(37 * 5, dtype=torch.float32).reshape(37, 5) / 3,
    }


STEP = 1234


# -- launcher (parent side) -------------------------------------------------------------------


def server_options(server: Any) -> dict[str, Any]:
    """The S3 options ranks need to reach a test server (a ``LocalS3Server``)."""
    return {
        "endpoint_url": server.endpoint_url,
        "access_key_id": server.access_key,
        "secret_access_key": server.secret_key,
        "region": server.region,
    }


def run_ranks(fn: Any, world_size: int, *args: Any, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world_size, port, *args)`` on ``world_size`` new processes,
    ``port`` held for their rendezvous (:func:`s3_servers.held_port`: a port found free
    and let go stays free only by luck until rank 0 binds it; the TCPStore of rank 0 sets
    SO_REUSEADDR, so it binds the held port as if it were free).

    Raises (``torch.multiprocessing.ProcessRaisedException`` with the rank's traceback,
    or ``ProcessExitedException``) as soon as one rank fails, after the others are
    killed; raises ``TimeoutError`` if the ranks are not all done after ``timeout`` s.
    """
    from s3_servers import held_port  # parent side only

    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(RANK_PRELOAD)
    with held_port() as port:
        context = tmp.start_processes(
            _in_environment,
            args=(fn, dict(os.environ), world_size, port, *args),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > deadline:
                    _dump_stacks(context.processes)
                    raise TimeoutError(
                        f"{world_size} ranks of {fn.__name__} still running after {timeout} s"
                    )
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(timeout=10)


def _in_environment(rank: int, fn: Any, environ: dict[str, str], *args: Any) -> None:
    """``fn(rank, *args)`` in the environment the parent had as it started the ranks (a
    rank forked from the forkserver would have the forkserver's)."""
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)


def _dump_stacks(processes: list[Any]) -> None:
    """Ask every rank still running to print its threads' stacks (:func:`_init` registers
    ``faulthandler`` on SIGUSR1), so that a timed-out test shows where each rank waits."""
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGUSR1)
    time.sleep(1.0)


# -- rank side --------------------------------------------------------------------------------


def _init(rank: int, world_size: int, port: int) -> None:
    # A rank that dies of a signal (a native library's abort, a crash) prints every
    # thread's Python stack first, so the failed test shows where it was.
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )


def _report(out_dir: str, rank: int, report: dict[str, Any]) -> None:
    torch.save(report, Path(out_dir) / f"rank{rank}.pt")


def _writer(uri: str, s3: dict[str, Any]) -> Any:
    from s3ckpt import S3StorageWriter

    return S3StorageWriter(uri, **s3)


def _reader(uri: str, s3: dict[str, Any]) -> Any:
    from s3ckpt import S3StorageReader

    return S3StorageReader(uri, **s3)


def _save_and_reload_per_rank(
    rank: int, world_size: int, uri: str, s3: dict[str, Any]
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    dcp.save(per_rank_state(rank, world_size), storage_writer=_writer(uri, s3))
    loaded = empty_like_state(per_rank_state(rank, world_size))
    dcp.load(loaded, storage_reader=_reader(uri, s3))
    return loaded


def two_rank_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], uris: dict[str, str], out_dir: str
) -> None:
    """Save and reload the per-rank state; save the DTensor state sharded Shard(0) on 2 ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    _init(rank, world_size, port)
    try:
        loaded = _save_and_reload_per_rank(rank, world_size, uris["per_rank"], s3)

        mesh = init_device_mesh("cpu", (world_size,))
        state: dict[str, Any] = {
            k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in dtensor_full_state().items()
        }
        state["step"] = torch.tensor(STEP)
        dcp.save(state, storage_writer=_writer(uris["dtensor"], s3))
        dist.barrier()
        _report(
            out_dir,
            rank,
            {
                "per_rank": loaded,
                "saved_local_shapes": {
                    k: tuple(v.to_local().shape) for k, v in state.items() if k != "step"
                },
            },
        )
    finally:
        dist.destroy_process_group()


def four_rank_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], uris: dict[str, str], out_dir: str
) -> None:
    """Save and reload the per-rank state on 4 ranks; load the 2-rank DTensor checkpoint resharded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    _init(rank, world_size, port)
    try:
        loaded = _save_and_reload_per_rank(rank, world_size, uris["per_rank"], s3)

        mesh = init_device_mesh("cpu", (world_size,))
        full = dtensor_full_state()
        target: dict[str, Any] = {
            k: distribute_tensor(torch.full_like(full[k], 7), mesh, [Shard(dim)])
            for k, dim in RESHARD_DIMS.items()
        }
        target["step"] = torch.tensor(0)
        dcp.load(target, storage_reader=_reader(uris["dtensor"], s3))
        report: dict[str, Any] = {"per_rank": loaded, "step": target["step"], "dtensor": {}}
        for key, dim in RESHARD_DIMS.items():
            dt = target[key]
            expected = distribute_tensor(full[key], mesh, [Shard(dim)]).to_local()
            report["dtensor"][key] = {
                "placements": [str(p) for p in dt.placements],
                "local": dt.to_local().clone(),
                "expected_local": expected.clone(),
                "full": dt.full_tensor(),
            }
        _report(out_dir, rank, report)
    finally:
        dist.destroy_process_group()


def process_mode_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], uris: dict[str, str], out_dir: str
) -> None:
    """``async_save`` with ``AsyncCheckpointerType.PROCESS``: good save, failing save, good save.

    The DCP background process is shut down (TERMINATE, join) before the rank exits; its
    pid and exit code are reported so that the parent can check nothing is left running.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import _async_process_executor as ape
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from s3ckpt.errors import BucketNotFoundError

    _init(rank, world_size, port)
    report: dict[str, Any] = {}
    try:
        state = process_mode_state(rank)
        future = dcp.async_save(
            state,
            storage_writer=_writer(uris["first"], s3),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        for value in state.values():  # staged already: must not reach the checkpoint
            value.add_(1)
        future.result(timeout=120)

        failing = dcp.async_save(
            process_mode_state(rank),
            storage_writer=_writer(uris["missing_bucket"], s3),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        try:
            failing.result(timeout=120)
            report["failure"] = None
        except (
            CheckpointException
        ) as exc:  # a BaseException: what reached the caller, across processes
            found = find_exceptions(exc)
            report["failure"] = {
                "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
                "message": str(exc),
                "found_types": [f"{type(e).__module__}.{type(e).__qualname__}" for e in found],
                "bucket_not_found": any(isinstance(e, BucketNotFoundError) for e in found),
            }

        second = dcp.async_save(
            process_mode_state(rank, offset=10),
            storage_writer=_writer(uris["second"], s3),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        second.result(timeout=120)
    finally:
        background = ape._CHECKPOINT_PROCESS
        if background is not None:
            process = background._save_process
            report["background_pid"] = process.pid
            if process.is_alive():
                background._send(ape._CheckpointSaveProcessControlOpts.TERMINATE)
                process.join(timeout=30)
            if process.is_alive():  # do not leave it behind even if it ignored TERMINATE
                process.kill()
                process.join(timeout=10)
                report["background_killed"] = True
            report["background_exitcode"] = process.exitcode
            ape._CHECKPOINT_PROCESS = None
        _report(out_dir, rank, report)
        dist.destroy_process_group()


def process_mode_state(rank: int, offset: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + rank + offset)
    return {
        "a": torch.randn(32, 33, generator=g),
        "b": torch.arange(offset, offset + 100, dtype=torch.int32),
        "c": torch.randn(17, generator=g).to(torch.bfloat16),
    }


def find_exceptions(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception reachable from it: causes, contexts, DCP's ``failures``."""
    found: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop()
        if any(e is seen for seen in found):
            continue
        found.append(e)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        for failure in (getattr(e, "failures", None) or {}).values():
            # torch >= 2.x: (exception, traceback frames); older: WrappedException
            inner = (
                failure[0] if isinstance(failure, tuple) else getattr(failure, "exception", failure)
            )
            if isinstance(inner, BaseException):
                todo.append(inner)
    return found


# -- world size 8: a 2-D sharded save, loads on 8, 3 and 2 ranks -------------------------------

SAVE_MESH = (2, 4)  # 8 ranks: rows split in 2, columns in 4


def _record_whole_object_gets() -> list[str]:
    """Keys this process GETs whole (manifest, metadata, index objects), in order."""
    from s3ckpt.s3.store import ObjectStore

    seen: list[str] = []
    original = ObjectStore.get

    async def get(self: Any, key: str) -> bytes:
        seen.append(key)
        return await original(self, key)

    ObjectStore.get = get  # type: ignore[method-assign]
    return seen


def eight_rank_save_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], uri: str, out_dir: str
) -> None:
    """Save the DTensor state sharded [Shard(0), Shard(1)] over a 2x4 mesh of 8 ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    _init(rank, world_size, port)
    try:
        mesh = init_device_mesh("cpu", SAVE_MESH)
        state: dict[str, Any] = {
            k: distribute_tensor(v, mesh, [Shard(0), Shard(1)])
            for k, v in dtensor_full_state().items()
        }
        state["step"] = torch.tensor(STEP)
        dcp.save(state, storage_writer=_writer(uri, s3))
        local = {k: tuple(v.to_local().shape) for k, v in state.items() if k != "step"}
        _report(out_dir, rank, {"saved_local_shapes": local})
    finally:
        dist.destroy_process_group()


def reshard_load_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], uri: str, out_dir: str
) -> None:
    """Load the 8-rank checkpoint sharded Shard(world_size % 2) over ``world_size`` ranks with
    the reader given the group; report the shards, the full tensors, and every whole-object
    GET this rank made (and those of a first load of ``step`` alone, given no group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from s3ckpt import S3StorageReader

    _init(rank, world_size, port)
    try:
        gets = _record_whole_object_gets()
        # Without a process group, every rank reads the metadata itself: no collective.
        step_only = {"step": torch.tensor(0)}
        dcp.load(step_only, storage_reader=_reader(uri, s3))
        unshared, gets[:] = list(gets), []
        mesh = init_device_mesh("cpu", (world_size,))
        full = dtensor_full_state()
        dims = {key: world_size % 2 for key in full}  # Shard(0) on even sizes, Shard(1) on odd
        target: dict[str, Any] = {
            k: distribute_tensor(torch.full_like(full[k], 7), mesh, [Shard(dims[k])]) for k in full
        }
        target["step"] = torch.tensor(0)
        reader = S3StorageReader(uri, process_group=dist.group.WORLD, **s3)
        dcp.load(target, storage_reader=reader)
        report: dict[str, Any] = {
            "step": target["step"],
            "unshared_step": step_only["step"],
            "unshared_gets": unshared,
            "gets": list(gets),
            "tensors": {},
        }
        for key, dim in dims.items():
            expected = distribute_tensor(full[key], mesh, [Shard(dim)]).to_local()
            report["tensors"][key] = {
                "local": target[key].to_local().clone(),
                "expected_local": expected.clone(),
                "full": target[key].full_tensor(),
            }
        _report(out_dir, rank, report)
    finally:
        dist.destroy_process_group()
