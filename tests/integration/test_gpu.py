"""CUDA tensors through the whole save and load path: staging into pinned host memory,
snapshots that later training steps cannot change, and loads back onto the device.

These need a CUDA device and skip with that reason elsewhere; the GPU staging benchmark
(``benchmarks/gpu.py``) times the same paths.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import CheckpointManager, HostStager, S3StorageReader, S3StorageWriter

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MIB = 1 << 20


def cuda_state(seed: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes, an odd size and a non-contiguous view, all on the first device."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda", 0)
    matrix = torch.randn(1024, 777, generator=gen, device=dev)
    return {
        "w": torch.randn(4 * MIB // 4, generator=gen, device=dev),
        "bf16": torch.randn(3001, 17, generator=gen, device=dev).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 30, (12345,), generator=gen, device=dev),
        "t": matrix.t(),
    }


def zeros_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(t) for name, t in state.items()}


def expected_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().cpu().clone() for name, t in state.items()}


def assert_equal_on_device(loaded: dict[str, torch.Tensor], expected: dict[str, Any]) -> None:
    for name, tensor in loaded.items():
        assert tensor.is_cuda, name
        assert torch.equal(tensor.cpu(), expected[name]), name


def test_save_and_load_cuda_tensors(s3_prefix, s3_options):
    state = cuda_state(0)
    dcp.save(state, storage_writer=S3StorageWriter(s3_prefix, **s3_options))
    target = zeros_like(state)
    dcp.load(target, storage_reader=S3StorageReader(s3_prefix, **s3_options))
    assert_equal_on_device(target, expected_copy(state))


def test_async_save_snapshot_survives_the_next_step(s3_prefix, s3_options):
    """Pinned, non-blocking staging: the checkpoint holds the values at the call, although
    the tensors change on the device as soon as ``async_save`` returns."""
    stager = HostStager()
    state = cuda_state(1)
    try:
        for save in range(3):  # later saves reuse the pinned buffers
            for name, fresh in cuda_state(10 + save).items():
                state[name].copy_(fresh)
            uri = f"{s3_prefix}/save{save}"
            expected = expected_copy(state)
            future = dcp.async_save(
                state, storage_writer=S3StorageWriter(uri, **s3_options), async_stager=stager
            )
            for tensor in state.values():
                tensor.fill_(-7)  # the next training step
            getattr(future, "upload_completion", future).result()
            target = zeros_like(state)
            dcp.load(target, storage_reader=S3StorageReader(uri, **s3_options))
            assert_equal_on_device(target, expected)
    finally:
        stager.close()


def test_host_stager_stages_into_pinned_buffers_it_reuses():
    stager = HostStager()
    state = cuda_state(3)
    try:
        first = stager.stage(state)
        firsts = {name: t.data_ptr() for name, t in first.items()}
        for tensor in state.values():
            tensor.add_(1)
        second = stager.stage(state)
        for name, tensor in second.items():
            assert tensor.device.type == "cpu" and tensor.is_pinned(), name
            assert tensor.data_ptr() == firsts[name], name
            assert torch.equal(tensor, state[name].cpu()), name
    finally:
        stager.close()


class Shard:
    """A holder without ``__dict__``, as ``ShardedTensor``'s shards hold their data."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_host_stager_waits_for_copies_of_tensors_held_in_slots():
    """The copy must be complete when stage() returns, for tensors no dict walk finds."""
    stager = HostStager()
    source = torch.randn(64 * MIB // 4, device="cuda")
    try:
        for step in range(3):
            source.fill_(step)
            staged = stager.stage({"shard": Shard(source)})
            # no synchronize here: stage() must have waited for the copy
            assert torch.all(staged["shard"].tensor == step)
            assert stager._copier.devices == {source.device}
    finally:
        stager.close()


def test_manager_saves_snapshots_of_cuda_state(s3_prefix, s3_options):
    state = cuda_state(2)
    snapshots = {}
    with CheckpointManager(s3_prefix, **s3_options) as manager:
        for step in (1, 2, 3):
            for tensor in state.values():
                tensor.add_(step)
            snapshots[step] = expected_copy(state)
            manager.save(step, state)
            for tensor in state.values():
                tensor.fill_(-1)  # right after staging: must reach no checkpoint
        manager.wait()
        for step in (1, 2, 3):
            target = zeros_like(state)
            manager.load(step, target)
            assert_equal_on_device(target, snapshots[step])


def test_loads_into_cuda_pass_through_pinned_slabs_within_the_budget(
    s3_prefix, s3_options, monkeypatch
):
    """64 MiB of CUDA state through 16 MiB of pinned slabs: no host buffer of an item's
    size is allocated, no more slabs are held than there are, and every byte arrives."""
    from s3ckpt.dcp import device_load, restore

    gen = torch.Generator(device="cuda").manual_seed(9)
    dev = torch.device("cuda", 0)
    state = {
        "w": torch.randn(12 * MIB // 4 * 4, generator=gen, device=dev),  # 48 MiB
        "t": torch.randn(2048, 1024, generator=gen, device=dev).t(),  # a scratch on the device
        "bf16": torch.randn(4096, 1024, generator=gen, device=dev).to(torch.bfloat16),
        "norm": torch.randn(300, generator=gen, device=dev),  # small: a host buffer of its own
    }
    dcp.save(state, storage_writer=S3StorageWriter(s3_prefix, **s3_options))
    scratch: list[int] = []
    allocate = restore.byte_buffer
    monkeypatch.setattr(restore, "byte_buffer", lambda n: scratch.append(n) or allocate(n))
    held: list[int] = []
    take = device_load.Slabs.take

    def counted(slabs: device_load.Slabs) -> int:
        assert slabs.pinned and all(t.is_pinned() for t in slabs.tensors)
        slab = take(slabs)
        held.append(len(slabs.tensors) - len(slabs.free))
        return slab

    monkeypatch.setattr(device_load.Slabs, "take", counted)
    target = {name: torch.zeros_like(t) for name, t in state.items()}
    target["t"] = torch.zeros(1024, 2048, device=dev).t()
    reader = S3StorageReader(s3_prefix, bounce_bytes=16 * MIB, request_size=8 * MIB, **s3_options)
    dcp.load(target, storage_reader=reader)
    assert_equal_on_device(target, expected_copy(state))
    assert held and max(held) <= 2
    assert all(n < restore.SLAB_MIN_ITEM for n in scratch), scratch


def test_a_resharded_load_into_cuda_regions_is_bit_exact(s3_prefix, s3_options):
    """Regions of stored chunks (rows of a matrix) land in device scratch, narrowed there."""
    dev = torch.device("cuda", 0)
    full = torch.randn(4096, 1024, device=dev)
    dcp.save({"m": full}, storage_writer=S3StorageWriter(s3_prefix, **s3_options))
    target = {"m": torch.zeros(4096, 1024, device=dev)}
    reader = S3StorageReader(s3_prefix, bounce_bytes=16 * MIB, request_size=8 * MIB, **s3_options)
    dcp.load(target, storage_reader=reader)
    assert torch.equal(target["m"].cpu(), full.cpu())
