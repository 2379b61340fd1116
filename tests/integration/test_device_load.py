"""Loads whose items pass through the bounce slabs of ``s3ckpt.dcp.device_load``.

On a CUDA machine every destination in device memory takes this path (its own tests in
``test_gpu.py``). Here the fixture ``slabs_for_cpu`` routes CPU destinations through it
too: pieces, slabs, the download's budget, streamed checks, re-reads of damaged pieces
and the copies into the destination all run as they do for a GPU; only the copy itself
is synchronous (no pinned memory, no CUDA events on the CPU build).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import unwrap
from s3ckpt.dcp import device_load, restore
from s3ckpt.errors import ConfigError, CorruptCheckpointError

MiB = 1024 * 1024


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(6 * MiB, generator=g),  # 24 MiB: three pieces of one 8 MiB slab
        "t": torch.randn(2048, 1024, generator=g),  # loaded into a transposed view
        "bf16": torch.randn(1536, 1024, generator=g).to(torch.bfloat16),  # 3 MiB, one piece
        "odd": torch.randint(0, 1 << 30, (2 * MiB + 3,), generator=g),  # 16 MiB + 24 bytes
        **{f"norm.{i}": torch.randn(64 + i, generator=g) for i in range(20)},  # own buffers
        "step": 7,
    }


def _targets() -> dict[str, Any]:
    targets: dict[str, Any] = {}
    for name, value in _state().items():
        if name == "t":
            targets[name] = torch.zeros(1024, 2048).t()  # non-contiguous: a scratch buffer
        elif isinstance(value, torch.Tensor):
            targets[name] = torch.zeros_like(value)
        else:
            targets[name] = 0
    return targets


def _assert_loaded(targets: dict[str, Any]) -> None:
    for name, value in _state().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(targets[name], value), name
        else:
            assert targets[name] == value, name


class SlabUse:
    """How many slabs a load held at once, and how many pieces it received."""

    def __init__(self) -> None:
        self.taken = 0
        self.most_held = 0
        self.counts: list[int] = []


@pytest.fixture
def slabs_for_cpu(monkeypatch: pytest.MonkeyPatch) -> SlabUse:
    use = SlabUse()
    monkeypatch.setattr(
        restore, "through_slabs", lambda destination, nbytes: nbytes >= restore.SLAB_MIN_ITEM
    )
    take = device_load.Slabs.take

    def counted(slabs: device_load.Slabs) -> int:
        slab = take(slabs)
        use.taken += 1
        use.most_held = max(use.most_held, len(slabs.tensors) - len(slabs.free))
        use.counts.append(len(slabs.tensors))
        return slab

    monkeypatch.setattr(device_load.Slabs, "take", counted)
    return use


@pytest.fixture
def host_scratch(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of every host scratch buffer a load allocates for an item."""
    sizes: list[int] = []
    allocate = restore.byte_buffer

    def recorded(nbytes: int) -> torch.Tensor:
        sizes.append(nbytes)
        return allocate(nbytes)

    monkeypatch.setattr(restore, "byte_buffer", recorded)
    return sizes


def test_items_pass_through_two_slabs_bit_exact(
    s3_prefix, make_writer, make_reader, slabs_for_cpu, host_scratch
):
    dcp.save(_state(), storage_writer=make_writer(s3_prefix))
    for _ in range(2):  # the second load reuses the slabs the first one kept
        targets = _targets()
        dcp.load(
            targets,
            storage_reader=make_reader(s3_prefix, bounce_bytes=16 * MiB, request_size=8 * MiB),
        )
        _assert_loaded(targets)
    # 24 + 8 + 3 + 16 MiB in 8 MiB pieces: 3 + 1 + 1 + 3 per load, never more than two held
    assert slabs_for_cpu.taken == 16
    assert set(slabs_for_cpu.counts) == {2}
    assert slabs_for_cpu.most_held <= 2
    assert all(size < restore.SLAB_MIN_ITEM for size in host_scratch), host_scratch


def test_a_damaged_piece_is_read_again_into_its_slab(
    local_s3, s3_prefix, make_writer, make_reader, slabs_for_cpu, caplog
):
    from faultproxy import FaultProxy, Rule

    dcp.save(_state(), storage_writer=make_writer(s3_prefix))
    targets = _targets()
    with FaultProxy(local_s3.endpoint_url) as proxy:
        proxy.add(Rule("corrupt", methods=("GET",), match="/data", after=5 * MiB, limit=2))
        reader = make_reader(
            s3_prefix, endpoint_url=proxy.endpoint_url, bounce_bytes=16 * MiB, request_size=8 * MiB
        )
        with caplog.at_level(logging.WARNING, logger="s3ckpt.dcp.device_load"):
            dcp.load(targets, storage_reader=reader)
    assert proxy.counts["corrupt"] == 2
    _assert_loaded(targets)
    assert caplog.text.count("reading it again") == 2


def test_damage_that_persists_fails_the_load_and_frees_the_slabs(
    local_s3, s3_prefix, make_writer, make_reader, slabs_for_cpu
):
    from faultproxy import FaultProxy, Rule

    dcp.save(_state(), storage_writer=make_writer(s3_prefix))
    with FaultProxy(local_s3.endpoint_url) as proxy:
        proxy.add(Rule("corrupt", methods=("GET",), match="/data", after=MiB, per_request=None))
        reader = make_reader(
            s3_prefix, endpoint_url=proxy.endpoint_url, bounce_bytes=16 * MiB, request_size=8 * MiB
        )
        with pytest.raises(BaseException) as raised:
            dcp.load(_targets(), storage_reader=reader)
    assert isinstance(unwrap(raised.value), CorruptCheckpointError)
    targets = _targets()  # the slabs of the failed load are all free again
    dcp.load(
        targets, storage_reader=make_reader(s3_prefix, bounce_bytes=16 * MiB, request_size=8 * MiB)
    )
    _assert_loaded(targets)


def test_compressed_items_decode_into_buffers_made_when_they_arrive(
    s3_prefix, make_writer, make_reader, slabs_for_cpu, host_scratch
):
    """Compressed items never pass through slabs (there is nothing to copy until they are
    decoded); their raw scratch is allocated when they are decoded, not up front."""
    state = {"zeros": torch.zeros(2048, 2048), "w": torch.randn(MiB)}
    dcp.save(state, storage_writer=make_writer(s3_prefix, compression="zstd"))
    targets = {"zeros": torch.zeros(2048, 2048).t(), "w": torch.zeros(MiB)}
    dcp.load(
        targets, storage_reader=make_reader(s3_prefix, bounce_bytes=16 * MiB, request_size=8 * MiB)
    )
    assert torch.equal(targets["zeros"], torch.zeros(2048, 2048))
    assert torch.equal(targets["w"], state["w"])
    assert slabs_for_cpu.taken == 0
    assert host_scratch == [16 * MiB]  # "zeros" only: "w" decodes into its destination


def test_bounce_bytes_must_be_positive(make_reader, s3_prefix):
    with pytest.raises(ConfigError, match="bounce_bytes"):
        make_reader(s3_prefix, bounce_bytes=0)
