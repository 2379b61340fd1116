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
from slotted import Slotted

from s3ckpt import CheckpointManager, HostStager, S3StorageReader, S3StorageWriter

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

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


def test_host_stager_waits_for_copies_of_tensors_held_in_slots():
    """The copy must be complete when stage() returns, for tensors no dict walk finds."""
    stager = HostStager()
    source = torch.randn(64 * MIB // 4, device="cuda")
    try:
        for step in range(3):
            source.fill_(step)
            staged = stager.stage({"shard": Slotted(source)})
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


def _arrived_on_cuda(nbytes: int) -> Any:
    """An item of ``nbytes`` random stored bytes, all of them received into CUDA memory."""
    from types import SimpleNamespace

    from s3ckpt.dcp.tensor_bytes import tensor_view
    from s3ckpt.format.checksums import block_crcs

    stored = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    crcs = block_crcs(tensor_view(stored), MIB)
    return SimpleNamespace(raw=stored.cuda(), span=(0, nbytes), what="item 'w'",
                           stored=SimpleNamespace(block_size=MIB, crc32c=crcs))  # fmt: skip


def test_bytes_received_into_cuda_are_checked_through_pinned_slabs():
    """What a rank received over NCCL is copied back through pinned slabs and checked:
    intact bytes pass (more pieces than slabs), one flipped byte is found."""
    from s3ckpt.dcp.device_load import Slabs
    from s3ckpt.dcp.shared_read import check_received
    from s3ckpt.errors import CorruptCheckpointError

    slabs = Slabs(2 * MIB, 2, pinned=True)
    items = [_arrived_on_cuda(9 * MIB + 5), _arrived_on_cuda(3 * MIB)]
    check_received([(item, 1) for item in items], slabs)
    items[0].raw[7 * MIB + 3] ^= 0xFF
    with pytest.raises(CorruptCheckpointError, match=r"passed on by rank 1\) \(block 7,"):
        check_received([(item, 1) for item in items], slabs)


@pytest.mark.distributed
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: 2 CUDA devices"
)
def test_shared_reads_carry_cuda_destinations_over_nccl(seaweedfs_s3, tmp_path):
    """Two ranks, one GPU each, a "cpu:gloo,cuda:nccl" group, DDP copies of the state in
    CUDA memory: read once from the store, sent and received in device memory over NCCL,
    no host buffer of an item's size, pinned slabs within the budget, bit-exact; damage
    between the ranks fails the load on both."""
    import secrets

    import _device_share_worker as share_worker
    import _dist_worker as worker
    from faultproxy import FaultProxy

    from s3ckpt.dcp.restore import SLAB_MIN_ITEM

    s3 = worker.server_options(seaweedfs_s3)
    uri = f"s3://{seaweedfs_s3.bucket}/nccl-share-{secrets.token_hex(4)}"
    dcp.save(share_worker.raw_state(), storage_writer=S3StorageWriter(uri, **s3), no_dist=True)
    with FaultProxy(s3["endpoint_url"]) as proxy:
        through = {**s3, "endpoint_url": proxy.endpoint_url}
        worker.run_ranks(share_worker.nccl_main, 2, s3, through, uri, str(tmp_path), timeout=300)
        fetched = proxy.body_bytes["GET"]
    reports = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    stored = share_worker.tensor_bytes(share_worker.raw_state())
    for rank, report in enumerate(reports):
        assert report["error"] is None, (rank, report["error"])
        assert report["carriage"] == "device" and report["on_device"], rank
        assert all(report["exact"].values()), (rank, report["exact"])
        assert report["sent_from_device"] and all(report["sent_from_device"]), rank
        assert all(n < SLAB_MIN_ITEM for n in report["host_buffers"]), report["host_buffers"]
        assert report["checkouts"] and all(pinned for _, _, pinned in report["checkouts"])
        assert all(size * count <= share_worker.BOUNCE for size, count, _ in report["checkouts"])
        assert "passed on by rank" in (report["damaged"] or ""), (rank, report["damaged"])
    assert sum(r["received"].get("device:cuda", 0) for r in reports) == stored
    assert fetched <= stored + 256 * 1024, (fetched, stored)
