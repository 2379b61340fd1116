"""The checkpoint process's staging, in one process: the shared-memory arena, the copy of
a state into it, the pickle that sends it by reference, sharded tensors without a mesh,
and the channel's messages and descriptors."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from s3ckpt.background.arena import ALIGN, StagingArena
from s3ckpt.background.arena_copy import copy_into_arena
from s3ckpt.background.channel import Channel, ChannelClosed, dumps_staged, loads_staged
from s3ckpt.background.shards import StagedShards

MIB = 1024 * 1024


@pytest.fixture
def arena() -> Iterator[StagingArena]:
    """A staging arena of the test's own, closed after it."""
    made = StagingArena()
    yield made
    made.close()


class Marker:
    """A class object in the state: values the stage does not walk are kept as they are."""


def state(step: float) -> dict:
    weights = torch.full((64, 32), step)
    return {
        "model": {"w": weights, "w_t": weights.t(), "b": torch.arange(5) + int(step)},
        "param": torch.nn.Parameter(torch.ones(3)),
        "extra": {"cls": Marker, "step": int(step), "names": ("a", "b"), "none": None},
        "list": [torch.zeros(2, dtype=torch.bfloat16), 7],
    }


def test_the_same_sizes_get_the_same_regions_and_growth_adds_one_segment(arena: StagingArena):
    regions, added = arena.allocate([10, 5000, 0, 3])
    assert len(added) == 1 and [r.segment for r in regions] == [0, 0, 0, 0]
    assert all(r.offset % ALIGN == 0 for r in regions)
    assert regions[1].offset >= 10 and regions[2].offset >= regions[1].offset + 5000
    again, added_again = arena.allocate([10, 5000, 0, 3])
    assert again == regions and added_again == []
    grown, more = arena.allocate([10, 100 * MIB])  # does not fit the first segment
    assert len(more) == 1 and grown[1].segment == 1 and grown[1].offset == 0
    assert arena.nbytes == sum(s.size for s in arena.segments)


def test_a_stage_is_a_copy_with_shared_storages_strides_and_values_kept(arena: StagingArena):
    live = state(1.0)
    staged = copy_into_arena(arena, live)
    copy = staged.state_dict
    assert torch.equal(copy["model"]["w"], live["model"]["w"])
    assert copy["model"]["w_t"].stride() == live["model"]["w_t"].stride()
    # one storage, one copy: the transposed view sees the copied weights
    assert copy["model"]["w"].untyped_storage().data_ptr() == (
        copy["model"]["w_t"].untyped_storage().data_ptr()
    )
    assert copy["param"].requires_grad and type(copy["param"]) is torch.Tensor
    assert copy["extra"] == live["extra"] and copy["extra"]["cls"] is Marker
    assert copy["list"][1] == 7 and copy["list"][0].dtype == torch.bfloat16
    first_ptr = copy["model"]["w"].data_ptr()
    live["model"]["w"].fill_(2.0)  # training goes on: the copy does not move
    assert torch.equal(copy["model"]["w"], torch.full((64, 32), 1.0))
    second = copy_into_arena(arena, live).state_dict
    assert second["model"]["w"].data_ptr() == first_ptr  # the same memory, reused
    assert torch.equal(second["model"]["w"], torch.full((64, 32), 2.0))
    assert arena.locate(first_ptr, 64 * 32 * 4) is not None


def test_storages_of_every_length_and_alignment_are_copied_byte_for_byte(arena: StagingArena):
    """The copy views both sides as the widest words the length and the source's address
    allow: odd lengths and odd addresses fall back to narrower ones, never lose a byte."""
    backing = bytearray(range(256)) * 4
    live = {
        f"{length}@{offset}": torch.frombuffer(backing, dtype=torch.uint8, count=length,
                                               offset=offset)
        for length in (1, 2, 3, 4, 6, 8, 12, 24, 1000) for offset in (0, 1, 2, 4, 8)
    }  # fmt: skip
    live["empty"] = torch.empty(0)
    for _ in range(2):  # the second copy goes into the regions' kept tensors
        copy = copy_into_arena(arena, live).state_dict
        for key, tensor in live.items():
            assert copy[key].tolist() == tensor.tolist(), key
        backing[:] = bytes(255 - b for b in backing)  # the next copy sees new bytes


def test_the_regions_tensors_are_kept_for_the_next_copy_only(arena: StagingArena):
    regions, _ = arena.allocate([100, 200])
    first = arena.views(regions)
    assert [v.nbytes for v in first] == [100, 200]
    assert all(a is b for a, b in zip(arena.views(regions), first, strict=True))
    other, _ = arena.allocate([300])
    assert arena.views(other)[0].nbytes == 300
    # the regions of two copies ago are made anew, not kept forever
    assert arena.views(regions)[0] is not first[0]


def test_staged_state_pickles_by_reference_and_unpickles_over_the_same_memory(arena: StagingArena):
    live = {"big": torch.randn(1024, 1024), "small": torch.arange(3), "n": 1}
    staged = copy_into_arena(arena, live).state_dict
    data = dumps_staged(staged, arena)
    assert len(data) < 4096  # 4 MiB of tensors described, not copied
    loaded = loads_staged(data, arena.mappings)
    assert torch.equal(loaded["big"], live["big"]) and loaded["n"] == 1
    assert loaded["big"].data_ptr() == staged["big"].data_ptr()
    outside = {"t": torch.randn(100)}  # not in the arena: pickled whole, as torch does
    assert torch.equal(
        loads_staged(dumps_staged(outside, arena), arena.mappings)["t"], outside["t"]
    )


def test_the_stages_placed_regions_pickle_what_looking_each_tensor_up_does(arena: StagingArena):
    live = state(3.0)
    staged = copy_into_arena(arena, live)
    tensors = [v for v in _leaves(staged.state_dict) if isinstance(v, torch.Tensor)]
    assert {id(t) for t in tensors} == set(staged.placed)  # every copy, nothing else
    placed = dumps_staged(staged.state_dict, arena, staged.placed)
    assert placed == dumps_staged(staged.state_dict, arena)  # the same bytes
    loaded = loads_staged(placed, arena.mappings)
    assert torch.equal(loaded["model"]["w_t"], live["model"]["w_t"])
    assert loaded["param"].requires_grad and loaded["extra"] == live["extra"]


def _leaves(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def test_lazy_conjugate_and_negative_views_are_staged_as_their_values(arena: StagingArena):
    z = torch.randn(6, dtype=torch.complex64)
    live = {"conj": z.conj(), "neg_imag": z.conj().imag, "z": z}
    staged = copy_into_arena(arena, live).state_dict
    for key, value in live.items():
        assert torch.equal(staged[key], value.resolve_conj().resolve_neg()), key
        assert not staged[key].is_conj() and not staged[key].is_neg(), key
    loaded = loads_staged(dumps_staged(staged, arena), arena.mappings)
    assert all(torch.equal(loaded[k], staged[k]) for k in live)


def test_every_kind_of_staged_tensor_unpickles_as_it_was(arena: StagingArena):
    base = torch.randn(8, 6)
    live = {
        "w": base,
        "w_t": base.t(),  # same storage, other strides
        "rows": base[2:5],  # a storage offset
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "grad": torch.randn(3, requires_grad=True),
        "empty": torch.empty(0, 4),
        "complex": torch.randn(4, dtype=torch.complex64),
        "tagged": torch.arange(4.0),
    }
    staged = copy_into_arena(arena, live).state_dict
    staged["conj"] = staged["complex"].conj()  # a lazy conjugate view
    staged["tagged"].tag = "kept"  # a Python attribute: pickled by torch, with it
    loaded = loads_staged(dumps_staged(staged, arena), arena.mappings)
    for key, value in staged.items():
        got = loaded[key]
        assert type(got) is torch.Tensor and got.dtype == value.dtype, key
        assert got.shape == value.shape and got.stride() == value.stride(), key
        assert torch.equal(got.resolve_conj(), value.resolve_conj()), key
        assert got.requires_grad == value.requires_grad, key
        if value.numel():
            assert got.data_ptr() == value.data_ptr(), key  # over the arena, not copied
    assert loaded["w"].untyped_storage().data_ptr() == (loaded["w_t"].untyped_storage().data_ptr())
    loaded["w"][0, 0] = 42.0  # one storage after loading too
    assert loaded["w_t"][0, 0] == 42.0 and loaded["rows"].storage_offset() == 12
    assert loaded["conj"].is_conj() and loaded["tagged"].tag == "kept"


def _item(offsets: list[int], sizes: list[int], whole: list[int], like: torch.Tensor) -> WriteItem:
    return WriteItem(
        index=MetadataIndex("", torch.Size(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties.create_from_tensor(like),
            size=torch.Size(whole),
        ),
    )


def test_staged_shards_save_the_metadata_of_the_sharded_tensor(tmp_path: Path, arena: StagingArena):
    """The lower half of an 8x8 tensor, saved by a process with no mesh: DCP writes the
    global shape and the shard's offsets, as it would for the DTensor."""
    shard = torch.arange(32.0).reshape(4, 8)
    staged = copy_into_arena(arena, {"shard": shard}).state_dict["shard"]
    shards = StagedShards.of([_item([4, 0], [4, 8], [8, 8], shard)], [staged])
    sent = loads_staged(dumps_staged({"w": shards}, arena), arena.mappings)["w"]
    assert isinstance(sent, StagedShards) and torch.equal(sent._s3ckpt_shards[0], shard)
    metadata = dcp.save({"w": sent}, checkpoint_id=str(tmp_path), no_dist=True)
    stored = metadata.state_dict_metadata["w"]
    assert stored.size == torch.Size([8, 8])
    assert [(c.offsets, c.sizes) for c in stored.chunks] == [
        (torch.Size([4, 0]), torch.Size([4, 8]))
    ]


def test_messages_and_descriptors_cross_the_channel(arena: StagingArena):
    ours, theirs = socket.socketpair()
    sender, receiver = Channel(ours), Channel(theirs)
    try:
        arena.allocate([100])
        segment = arena.segments[0]
        segment.view(0, 4).copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
        got: list = []
        reader = threading.Thread(target=lambda: got.extend([receiver.receive() for _ in range(2)]))
        reader.start()
        sender.send(("segments", [segment.size]), [segment.fd])
        sender.send(("big", b"x" * (3 * MIB)))  # larger than the socket's buffers
        reader.join(timeout=30)
        (first, fds), (second, no_fds) = got
        assert first == ("segments", [segment.size]) and len(fds) == 1 and no_fds == []
        assert second == ("big", b"x" * (3 * MIB))
        mapped = StagingArena()
        mapped.adopt(fds[0], first[1][0])
        assert mapped.segments[0].view(0, 4).tolist() == [1, 2, 3, 4]  # the same memory
        mapped.close()
        sender.close()
        try:
            receiver.receive()
            raise AssertionError("a closed channel must raise ChannelClosed")
        except ChannelClosed:
            pass
    finally:
        receiver.close()
