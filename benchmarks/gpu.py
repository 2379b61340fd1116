"""The GPU staging case: how long training stalls in an async save of CUDA tensors.

The promise of asynchronous checkpointing is that the training loop waits only for the
device-to-host copy. This case measures exactly that, on the benchmark state dict moved to
the first CUDA device, three ways, each several times (the first save of each allocates
its pinned staging buffers; later saves reuse them, which is the steady state):

* ``d2h``: the floor, a bare copy of the same tensors into pinned host buffers allocated
  once (``non_blocking`` copies, then one ``torch.cuda.synchronize``);
* ``stage``: :meth:`s3ckpt.HostStager.stage` alone, the copy the two saves below block on;
* ``dcp.async_save`` with :class:`S3StorageWriter` and an :class:`s3ckpt.HostStager`
  keeping pinned buffers across saves (non-blocking copies, one synchronize, staging in
  the caller): the time until ``async_save`` returns, and the time until the upload
  committed;
* :meth:`s3ckpt.CheckpointManager.save` (thread mode): the time until ``save`` returns,
  and until ``wait`` returns (commit).

The target: blocked time (after the first save) no more than 1.2x the bare copy. Without
CUDA the case reports why it did not run instead of a number.

The ``gpu_load`` case times a load into CUDA tensors (``dcp.load`` with
:class:`S3StorageReader`: every item through the pinned bounce slabs of
:mod:`s3ckpt.dcp.device_load`, copies to the device overlapped with the network) against
its two parts run alone: the network read of the same checkpoint into CPU tensors
(received in place) and a bare pinned host-to-device copy of the same bytes. Target: the
load into the device takes at most 1.15x their sum.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

STAGING_TARGET = 1.2
GPU_LOAD_TARGET = 1.15


def cuda_skip_reason() -> str | None:
    """Why the GPU case cannot run here, or None when a CUDA device is usable."""
    if not torch.backends.cuda.is_built():
        return f"no CUDA: this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA: torch has CUDA support but no device is available"
    return None


def staging_summary(samples: list[dict[str, float]]) -> dict[str, float]:
    """Medians over the saves after the first (buffers reused), and the target ratios."""
    steady = samples[1:] or samples
    out = {
        key: statistics.median(s[key] for s in steady)
        for key in ("d2h", "stage", "async_blocked", "async_commit", "manager_blocked",
                    "manager_commit")
        if all(key in s for s in steady)
    }  # fmt: skip
    out["async_blocked_over_d2h"] = out["async_blocked"] / out["d2h"]
    out["manager_blocked_over_d2h"] = out["manager_blocked"] / out["d2h"]
    out["first_async_blocked"] = samples[0]["async_blocked"]
    return out


def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def gpu_staging_case(
    state: dict[str, torch.Tensor], uri: Callable[[str, int], str], options: dict[str, Any]
) -> Callable[[int], dict[str, float]]:
    """The per-rep callable of the case (``uri(system, rep)`` names each checkpoint)."""
    import torch.distributed.checkpoint as dcp

    from s3ckpt import CheckpointManager, HostStager, S3StorageWriter

    device = torch.device("cuda", 0)
    gpu_state = {name: tensor.to(device) for name, tensor in state.items()}
    pinned = {name: torch.empty_like(t, device="cpu").pin_memory() for name, t in gpu_state.items()}
    stager = HostStager(pin_memory=True)
    manager = CheckpointManager(uri("gpu-manager", 0).rsplit("/", 1)[0], **options)
    torch.cuda.synchronize(device)

    def d2h() -> None:
        for name, tensor in gpu_state.items():
            pinned[name].copy_(tensor, non_blocking=True)
        torch.cuda.synchronize(device)

    def rep(i: int) -> dict[str, float]:
        copy_s, _ = _timed(d2h)
        writer = S3StorageWriter(uri("gpu-async", i), **options)
        blocked, future = _timed(
            lambda: dcp.async_save(gpu_state, storage_writer=writer, async_stager=stager)
        )
        upload = future.upload_completion if hasattr(future, "upload_completion") else future
        commit, _ = _timed(upload.result)
        stage_s, _ = _timed(lambda: stager.stage(gpu_state))  # after: buffers in place
        manager_blocked, _ = _timed(lambda: manager.save(i, gpu_state))
        manager_commit, _ = _timed(manager.wait)
        return {
            "d2h": copy_s,
            "stage": stage_s,
            "async_blocked": blocked,
            "async_commit": blocked + commit,
            "manager_blocked": manager_blocked,
            "manager_commit": manager_blocked + manager_commit,
        }

    return rep


def gpu_load_summary(samples: list[dict[str, float]]) -> dict[str, float]:
    """Medians over the loads after the first (slabs pinned once), and the target ratio."""
    steady = samples[1:] or samples
    out = {key: statistics.median(s[key] for s in steady) for key in ("network", "h2d", "gpu_load")}
    out["gpu_load_over_parts"] = out["gpu_load"] / (out["network"] + out["h2d"])
    out["first_gpu_load"] = samples[0]["gpu_load"]
    return out


def gpu_load_case(
    state: dict[str, torch.Tensor], uri: Callable[[str, int], str], options: dict[str, Any]
) -> Callable[[int], dict[str, float]]:
    """The per-rep callable of ``gpu_load``: one save, then each rep loads it three ways."""
    import torch.distributed.checkpoint as dcp

    from s3ckpt import S3StorageReader, S3StorageWriter

    device = torch.device("cuda", 0)
    location = uri("gpu-load", 0)
    dcp.save(state, storage_writer=S3StorageWriter(location, **options))
    on_host = {name: torch.empty_like(t) for name, t in state.items()}
    pinned = {name: t.clone().pin_memory() for name, t in state.items()}
    on_device = {name: torch.empty_like(t, device=device) for name, t in state.items()}
    torch.cuda.synchronize(device)

    def network() -> None:
        dcp.load(on_host, storage_reader=S3StorageReader(location, **options))

    def h2d() -> None:
        for name, tensor in pinned.items():
            on_device[name].copy_(tensor, non_blocking=True)
        torch.cuda.synchronize(device)

    def gpu_load() -> None:
        dcp.load(on_device, storage_reader=S3StorageReader(location, **options))
        torch.cuda.synchronize(device)

    def rep(i: int) -> dict[str, float]:
        network_s, _ = _timed(network)
        h2d_s, _ = _timed(h2d)
        gpu_s, _ = _timed(gpu_load)
        return {"network": network_s, "h2d": h2d_s, "gpu_load": gpu_s}

    return rep
