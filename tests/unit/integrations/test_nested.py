"""Splitting a trainer's nested checkpoint dict into DCP items and a skeleton, and back."""

from __future__ import annotations

import collections
import io

import pytest
import torch

from s3ckpt import CheckpointError, ConfigError
from s3ckpt.integrations.nested import SKELETON_KEY, _placed, join, load_nested, nested_items, split

Pair = collections.namedtuple("Pair", "left right")


def test_tensors_become_items_named_by_path_and_come_back_in_place() -> None:
    weight = torch.randn(3, 2)
    tree = {
        "state_dict": collections.OrderedDict(weight=weight),
        "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": []}],
        "pair": Pair(torch.zeros(2, dtype=torch.bfloat16), 5),
        "size": torch.Size([3, 2]),
        "epoch": 7,
    }
    tensors, skeleton = split(tree)
    assert set(tensors) == {
        "state_dict.weight",
        "optimizer_states.0.state.0.exp_avg",
        "pair.0",
    }
    assert len(skeleton) < 4096  # the tensors' bytes are not in the skeleton
    with pytest.raises(Exception, match=r"test_nested\.Pair"):  # a class of this module
        join(skeleton, tensors, weights_only=True)
    back = join(skeleton, tensors, weights_only=False)
    assert type(back["state_dict"]) is collections.OrderedDict
    assert back["state_dict"]["weight"] is tensors["state_dict.weight"]
    assert list(back["optimizer_states"][0]["state"]) == [0]  # int keys stay ints
    assert type(back["pair"]) is Pair and back["pair"].right == 5
    assert back["size"] == torch.Size([3, 2]) and back["epoch"] == 7
    assert tree["state_dict"]["weight"] is weight  # the input is not modified


def test_what_dcp_cannot_store_stays_in_the_skeleton() -> None:
    sparse = torch.eye(3).to_sparse()
    meta = torch.empty(4, device="meta")
    tensors, skeleton = split({"sparse": sparse, "meta": meta, "dense": torch.ones(1)})
    assert list(tensors) == ["dense"]
    back = join(skeleton, tensors, weights_only=True)
    assert torch.equal(back["sparse"].to_dense(), torch.eye(3))
    assert back["meta"].device.type == "meta" and back["meta"].shape == (4,)
    assert back["dense"] is tensors["dense"]


def test_names_never_collide_with_each_other_or_the_skeleton() -> None:
    tree = {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}, SKELETON_KEY: torch.ones(2)}
    tensors, skeleton = split(tree)
    assert len(tensors) == 3 and SKELETON_KEY not in tensors
    back = join(skeleton, tensors, weights_only=True)
    assert torch.equal(back["a.b"], torch.ones(1)) and torch.equal(back["a"]["b"], torch.zeros(1))
    assert torch.equal(back[SKELETON_KEY], torch.ones(2))


def test_a_skeleton_of_another_format_is_refused() -> None:
    buffer = io.BytesIO()
    torch.save({"format": 99}, buffer)
    with pytest.raises(CheckpointError, match="unknown nested checkpoint format"):
        join(buffer.getvalue(), {}, weights_only=True)


def test_prefixed_items_keep_several_trees_apart() -> None:
    one = nested_items({"w": torch.ones(2), "step": 3}, prefix="a.pt/")
    two = nested_items({"w": torch.zeros(2)}, prefix="b.pt/")
    assert set(one) == {"a.pt/w", f"a.pt/{SKELETON_KEY}"}
    assert set(two) == {"b.pt/w", f"b.pt/{SKELETON_KEY}"}
    back = join(one[f"a.pt/{SKELETON_KEY}"], {"w": one["a.pt/w"]}, weights_only=True)
    assert back["step"] == 3 and back["w"] is one["a.pt/w"]


def test_a_callable_map_location_is_called_as_torch_load_calls_it() -> None:
    tensor = torch.arange(6.0).reshape(2, 3)[:, 1:]  # a view: offset and strides kept
    calls = []

    def keep(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        calls.append(location)
        return storage

    assert _placed(tensor, keep) is tensor and calls == ["cpu"]
    assert _placed(tensor, lambda storage, location: None) is tensor
    copied = _placed(tensor, lambda storage, location: storage.clone())
    assert torch.equal(copied, tensor) and copied.stride() == tensor.stride()
    assert copied.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    assert _placed(tensor, "cpu") is tensor


def test_a_map_location_that_is_no_device_is_refused() -> None:
    with pytest.raises(ConfigError, match="map_location must be a device"):
        load_nested(None, map_location=5)  # type: ignore[arg-type]
