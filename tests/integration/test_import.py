"""``s3ckpt import``: a DCP folder, a safetensors set and a torch.save file saved as s3ckpt
checkpoints that ``dcp.load`` reads back bit-exact; a source that is no checkpoint, or a
committed destination, one clear line each."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist_worker import server_options
from safetensors.torch import save_file

from s3ckpt import S3StorageReader
from s3ckpt.catalog import show_checkpoint
from s3ckpt.interop import import_checkpoint
from s3ckpt.testing.local_s3 import LocalS3Server


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "embed.weight": torch.randn(50, 8, generator=g),
        "layers.0.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "layers.0.bias": torch.randn(8, generator=g).to(torch.float16),
        "positions": torch.arange(50, dtype=torch.int32),
    }


@pytest.fixture
def destination(seaweedfs_s3: LocalS3Server) -> str:
    return f"s3://{seaweedfs_s3.bucket}/test_import-{secrets.token_hex(4)}/imported"


def load_back(uri: str, server: LocalS3Server, template: dict[str, Any]) -> dict[str, Any]:
    target = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in template.items()
    }
    dcp.load(target, storage_reader=S3StorageReader(uri, **server_options(server)))
    return target


def assert_bit_exact(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert actual[name].dtype == value.dtype and actual[name].shape == value.shape
            assert torch.equal(actual[name].view(torch.uint8), value.view(torch.uint8)), name
        else:
            assert actual[name] == value, name


def test_dcp_folder(cli, tmp_path: Path, destination: str, seaweedfs_s3: LocalS3Server) -> None:
    state = {"model": weights(), "step": 17, "config": {"lr": 0.5, "name": "tiny"}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    result = cli("import", str(tmp_path / "dcp"), destination)
    assert result.code == 0, result.err
    assert result.out.startswith(f"imported {tmp_path / 'dcp'} (dcp: 4 tensors,")
    assert "3 other item(s)" in result.out
    template = {"model": weights(), "step": 0, "config": {"lr": 0.0, "name": ""}}
    loaded = load_back(destination, seaweedfs_s3, template)
    assert_bit_exact(loaded["model"], state["model"])
    assert (loaded["step"], loaded["config"]) == (17, {"lr": 0.5, "name": "tiny"})
    assert cli("verify", destination).code == 0


def test_safetensors_set(
    cli, tmp_path: Path, destination: str, seaweedfs_s3: LocalS3Server
) -> None:
    tensors = weights()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(tmp_path / shard))
    weight_map = {n: shard for shard, members in shards.items() for n in members}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    report = import_checkpoint(tmp_path, destination, **server_options(seaweedfs_s3))
    assert (report.format, report.tensors, report.others) == ("safetensors", 4, 0)
    assert_bit_exact(load_back(destination, seaweedfs_s3, tensors), tensors)


def test_single_safetensors_file(
    tmp_path: Path, destination: str, seaweedfs_s3: LocalS3Server
) -> None:
    tensors = weights()
    save_file(tensors, str(tmp_path / "weights.safetensors"))
    report = import_checkpoint(
        tmp_path / "weights.safetensors", destination, **server_options(seaweedfs_s3)
    )
    assert report.format == "safetensors"
    assert_bit_exact(load_back(destination, seaweedfs_s3, tensors), tensors)


def test_torch_save_file(
    cli, tmp_path: Path, destination: str, seaweedfs_s3: LocalS3Server
) -> None:
    state = {"model": weights(), "epoch": 3}
    torch.save(state, tmp_path / "checkpoint.pt")
    result = cli("import", str(tmp_path / "checkpoint.pt"), destination, "--json")
    assert result.code == 0, result.err
    assert result.json()["format"] == "torch"
    loaded = load_back(destination, seaweedfs_s3, {"model": weights(), "epoch": 0})
    assert_bit_exact(loaded["model"], state["model"])
    assert loaded["epoch"] == 3
    assert show_checkpoint(destination, **server_options(seaweedfs_s3)).save_id


# -- bad input: one clear line each --------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "absent", "{p}/absent: no such file or folder"),
        (
            lambda p: p,
            "{p} is not a checkpoint folder: it holds neither a DCP .metadata nor safetensors files",
        ),
        (
            lambda p: (p / "notes.txt").write_text("hello") and p / "notes.txt",
            "{p}/notes.txt is not a DCP checkpoint folder, safetensors file(s) or torch.save file",
        ),
        (
            lambda p: torch.save([1, 2, 3], p / "list.pt") or p / "list.pt",
            "{p}/list.pt holds no dict of tensors (list)",
        ),
        (
            lambda p: (p / ".metadata").write_bytes(b"") or p,
            "{p}: DCP cannot read this checkpoint folder (Ran out of input)",
        ),
    ],
    ids=["missing", "empty-folder", "text-file", "no-tensors", "empty-dcp-metadata"],
)
def test_a_source_that_is_not_a_checkpoint(
    cli, tmp_path: Path, destination: str, make: Any, message: str
) -> None:
    source = make(tmp_path)
    result = cli("import", str(source), destination)
    assert result.code == 1
    assert result.err.strip() == "s3ckpt import: error: " + message.format(p=tmp_path)


def test_a_committed_destination_is_refused_unless_overwrite(
    cli, tmp_path: Path, destination: str, seaweedfs_s3: LocalS3Server
) -> None:
    save_file(weights(), str(tmp_path / "a.safetensors"))
    assert cli("import", str(tmp_path / "a.safetensors"), destination).code == 0
    refused = cli("import", str(tmp_path / "a.safetensors"), destination)
    assert refused.code == 1
    assert len(refused.err.strip().splitlines()) == 1
    assert "already committed" in refused.err
    replaced = cli("import", str(tmp_path / "a.safetensors"), destination, "--overwrite")
    assert replaced.code == 0, replaced.err
    assert_bit_exact(load_back(destination, seaweedfs_s3, weights()), weights())
