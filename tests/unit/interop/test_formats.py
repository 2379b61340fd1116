"""The export's file writers on a local folder: safetensors shards and their index, the
streamed ``torch.save`` file (which relies on torch's skeleton layout), size parsing."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from s3ckpt.cli.interop_commands import parse_size
from s3ckpt.errors import ConfigError, OutputExistsError
from s3ckpt.interop.export import export_checkpoint
from s3ckpt.interop.formats import INDEX_NAME, TORCH_NAME, SafetensorsWriter, Spec, TorchWriter
from s3ckpt.interop.output import LocalOutput


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "a.weight": torch.randn(33, 7, generator=g),
        "a.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "ids": torch.arange(-5, 5, dtype=torch.int8),
    }


def specs_of(state: dict[str, torch.Tensor]) -> list[Spec]:
    return [Spec(name, t.dtype, tuple(t.shape)) for name, t in state.items()]


def output(path: Path) -> LocalOutput:
    out = LocalOutput(path)
    out.check(overwrite=False)
    return out


def assert_bit_exact(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert (actual[name].dtype, actual[name].shape) == (tensor.dtype, tensor.shape), name
        assert torch.equal(
            actual[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
        ), name


def test_safetensors_shards_and_index(tmp_path: Path) -> None:
    state = tensors()
    writer = SafetensorsWriter(output(tmp_path), specs_of(state), max_shard_size=12)
    for spec in writer.order:
        writer.write(spec.name, state[spec.name])
    writer.close()
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == len(writer.shards) > 2
    assert shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    loaded = {k: v for shard in shards for k, v in load_file(tmp_path / shard).items()}
    assert_bit_exact(loaded, state)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in state.values())


def test_safetensors_shards_a_model_index_assigns(tmp_path: Path) -> None:
    """Shards as a Hugging Face index numbers them (from 1; one left empty), each in the
    order given; a tensor the assignment does not place is refused before any write."""
    state = tensors()
    shard_of = {"a.weight": 3, "ids": 3, "a.bias": 1, "empty": 1, "flags": 1, "scalar": 1}
    writer = SafetensorsWriter(output(tmp_path), specs_of(state), 10**9, shard_of)
    for spec in writer.order:
        writer.write(spec.name, state[spec.name])
    writer.close()
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["weight_map"] == {k: names[i - 1] for k, i in sorted(shard_of.items())}
    assert list(load_file(tmp_path / names[1])) == []  # a valid, empty shard
    assert list(load_file(tmp_path / names[2])) == ["a.weight", "ids"]
    loaded = {k: v for name in names for k, v in load_file(tmp_path / name).items()}
    assert_bit_exact(loaded, state)
    with pytest.raises(ConfigError, match=r"places no shard for 1 tensor\(s\): ids"):
        SafetensorsWriter(
            output(tmp_path / "other"), specs_of(state), 10**9, {**shard_of, "ids": 0}
        )
    assert not (tmp_path / "other").joinpath(INDEX_NAME).exists()


def test_files_along_an_export_are_plain_names_of_their_own() -> None:
    for name in ("a/config.json", "..", "", INDEX_NAME, "model-00001-of-00002.safetensors"):
        with pytest.raises(ConfigError, match="along with an export"):
            export_checkpoint("s3://bucket/ckpt", "out", files={name: b"{}"})


def test_safetensors_header_is_padded_to_eight_bytes(tmp_path: Path) -> None:
    state = {"x": torch.ones(3)}
    writer = SafetensorsWriter(output(tmp_path), specs_of(state), max_shard_size=10**9)
    writer.write("x", state["x"])
    writer.close()
    raw = (tmp_path / "model.safetensors").read_bytes()
    length = int.from_bytes(raw[:8], "little")
    assert length % 8 == 0 and len(raw) == 8 + length + 12
    assert_bit_exact(load_file(tmp_path / "model.safetensors"), state)


def test_safetensors_refuses_what_it_cannot_hold(tmp_path: Path) -> None:
    specs = [Spec("z", torch.complex64, (2,))]
    with pytest.raises(ConfigError, match=r"safetensors cannot hold torch.complex64"):
        SafetensorsWriter(output(tmp_path), specs, max_shard_size=10**9)


def test_tensors_out_of_order_are_refused(tmp_path: Path) -> None:
    state = tensors()
    writer = SafetensorsWriter(output(tmp_path), specs_of(state), max_shard_size=10**9)
    wrong = next(name for name in state if name != writer.order[0].name)
    with pytest.raises(RuntimeError, match="out of order"):
        writer.write(wrong, state[wrong])


def test_torch_file_streamed_into_the_skeleton_loads_bit_exact(tmp_path: Path) -> None:
    state = tensors()
    writer = TorchWriter(output(tmp_path), specs_of(state))
    for name, tensor in state.items():
        writer.write(name, tensor)
    writer.close()
    assert not Path(writer._skeleton_path).exists()  # the temporary skeleton is gone
    loaded = torch.load(tmp_path / TORCH_NAME, weights_only=True)
    assert list(loaded) == list(state)
    assert_bit_exact(loaded, state)
    mapped = torch.load(tmp_path / TORCH_NAME, weights_only=True, mmap=True)
    assert_bit_exact(mapped, state)


def test_the_torch_skeleton_takes_no_disk_for_tensor_bytes(tmp_path: Path) -> None:
    specs = [Spec("big", torch.float32, (64 * 2**20,)), Spec("small", torch.int8, (3,))]
    writer = TorchWriter(output(tmp_path), specs)
    skeleton = os.stat(writer._skeleton_path)
    assert skeleton.st_size > 256 * 2**20 > 64 * skeleton.st_blocks * 512
    writer.discard()
    assert not os.path.exists(writer._skeleton_path)


def test_overwrite_removes_stale_export_files_only(tmp_path: Path) -> None:
    for name in ("model-00003-of-00003.safetensors", "pytorch_model.bin", "notes.md"):
        (tmp_path / name).write_text("old")
    with pytest.raises(OutputExistsError, match="pass --overwrite"):
        LocalOutput(tmp_path).check(overwrite=False)
    out = LocalOutput(tmp_path)
    out.check(overwrite=True)
    state = {"x": torch.ones(2)}
    writer = SafetensorsWriter(out, specs_of(state), max_shard_size=10**9)
    writer.write("x", state["x"])
    writer.close()
    out.finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model.safetensors",
        INDEX_NAME,
        "notes.md",
    ]


@pytest.mark.parametrize(
    ("text", "size"),
    [("5GB", 5 * 10**9), ("512MiB", 512 * 2**20), ("1000000", 10**6), ("1.5kb", 1500)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "five", "0", "-3GB", "5XB"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)
