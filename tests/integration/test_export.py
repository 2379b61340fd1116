"""``s3ckpt export``: a checkpoint saved by two ranks, tensors sharded across them, exported
to safetensors and torch files that load back bit-exact; every bad input one clear line.

The two-rank checkpoint is saved once per module (spawned gloo ranks, DTensors sharded by
rows, by columns and replicated) and exported by the CLI in-process.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import _cli_runner
import _dist_worker
import _interop_worker as worker
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist_worker import server_options
from safetensors.torch import load, load_file

from s3ckpt import S3StorageWriter
from s3ckpt.config import S3URI
from s3ckpt.errors import CorruptCheckpointError, OutputExistsError
from s3ckpt.interop import export_checkpoint
from s3ckpt.testing.local_s3 import LocalS3Server

EXPECTED = worker.sharded_state()


@pytest.fixture(scope="module")
def two_rank_checkpoint(seaweedfs_s3: LocalS3Server) -> str:
    uri = f"s3://{seaweedfs_s3.bucket}/test_export-{secrets.token_hex(4)}/step-1234"
    _dist_worker.run_ranks(worker.save_sharded_main, 2, server_options(seaweedfs_s3), uri)
    return uri


def safetensors_set(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an exported set, read shard by shard as its index says."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded = load_file(folder / shard)
        assert {k for k, v in index["weight_map"].items() if v == shard} == set(loaded)
        tensors.update(loaded)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    return tensors


def assert_bit_exact(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert actual[name].shape == tensor.shape, name
        assert torch.equal(actual[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_two_rank_checkpoint_exports_to_safetensors_shards_bit_exact(
    cli, two_rank_checkpoint: str, tmp_path: Path
) -> None:
    out = tmp_path / "hf"
    result = cli("export", two_rank_checkpoint, str(out), "--max-shard-size", "3KB")
    assert result.code == 0, result.err
    assert "exported" in result.out and "5 tensors" in result.out
    assert "1 non-tensor item(s) not exported: step" in result.err
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert_bit_exact(safetensors_set(out), EXPECTED)


def test_only_strips_the_prefix_and_dtype_converts_floating_tensors(
    cli, two_rank_checkpoint: str, tmp_path: Path
) -> None:
    out = tmp_path / "bf16"
    result = cli("export", two_rank_checkpoint, str(out), "--only", "model", "--dtype", "bf16")
    assert result.code == 0, result.err
    assert sorted(p.name for p in out.iterdir()) == [
        "model.safetensors",
        "model.safetensors.index.json",
    ]
    expected = {
        name.removeprefix("model."): tensor.to(torch.bfloat16)
        for name, tensor in EXPECTED.items()
        if name.startswith("model.")
    }
    assert_bit_exact(load_file(out / "model.safetensors"), expected)


def test_torch_format_loads_with_torch_load_bit_exact(
    cli, two_rank_checkpoint: str, tmp_path: Path
) -> None:
    result = cli("export", two_rank_checkpoint, str(tmp_path), "--format", "torch", "--json")
    assert result.code == 0, result.err
    assert result.json()["files"] == ["pytorch_model.bin"]
    loaded = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert_bit_exact(loaded, EXPECTED)


def test_export_to_an_s3_prefix(cli, two_rank_checkpoint: str, seaweedfs_s3: LocalS3Server) -> None:
    out = S3URI.parse(f"{two_rank_checkpoint.rsplit('/', 1)[0]}/exported-{secrets.token_hex(3)}")
    result = cli("export", two_rank_checkpoint, str(out), "--only", "model.")
    assert result.code == 0, result.err
    client = seaweedfs_s3.client()
    body = client.get_object(Bucket=out.bucket, Key=out.key("model.safetensors"))["Body"].read()
    expected = {k.removeprefix("model."): v for k, v in EXPECTED.items() if k.startswith("model.")}
    assert_bit_exact(load(body), expected)
    again = cli("export", two_rank_checkpoint, str(out), "--only", "model.")
    assert again.code == 2 and "--overwrite" in again.err
    assert len(again.err.strip().splitlines()) == 1


def test_a_large_tensor_streams_through_multipart_parts_to_s3(
    seaweedfs_s3: LocalS3Server, tmp_path: Path
) -> None:
    """A tensor larger than an upload part (64 MiB) goes up in several parts, and a
    single-process checkpoint exports just the same."""
    options = server_options(seaweedfs_s3)
    base = f"s3://{seaweedfs_s3.bucket}/test_export-big-{secrets.token_hex(4)}"
    big = {"w": torch.randn(70 * 1024 * 1024 // 4), "b": torch.arange(5)}
    dcp.save(big, storage_writer=S3StorageWriter(f"{base}/ckpt", **options))
    report = export_checkpoint(f"{base}/ckpt", f"{base}/out", window=1, **options)
    assert report.files == ["model.safetensors", "model.safetensors.index.json"]
    out = S3URI.parse(f"{base}/out")
    body = seaweedfs_s3.client().get_object(Bucket=out.bucket, Key=out.key("model.safetensors"))
    assert_bit_exact(load(body["Body"].read()), big)


# -- bad input: one clear line each --------------------------------------------------------


def test_uncommitted_checkpoint(cli, two_rank_checkpoint: str, tmp_path: Path) -> None:
    result = cli("export", f"{two_rank_checkpoint}-never-saved", str(tmp_path / "x"))
    assert result.code == 1
    assert result.err.startswith("s3ckpt export: error: no committed checkpoint at s3://")
    assert len(result.err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_damaged_checkpoint(seaweedfs_s3: LocalS3Server, tmp_path: Path) -> None:
    options = server_options(seaweedfs_s3)
    uri = f"s3://{seaweedfs_s3.bucket}/test_export-damaged-{secrets.token_hex(4)}"
    dcp.save({"w": torch.randn(4096)}, storage_writer=S3StorageWriter(uri, **options))
    location, client = S3URI.parse(uri), seaweedfs_s3.client()
    listing = client.list_objects_v2(Bucket=location.bucket, Prefix=location.key("data/"))
    key = listing["Contents"][0]["Key"]
    body = bytearray(client.get_object(Bucket=location.bucket, Key=key)["Body"].read())
    body[100] ^= 0xFF  # same size, one flipped byte
    client.put_object(Bucket=location.bucket, Key=key, Body=bytes(body))
    result = _cli_runner.entry_point(seaweedfs_s3, tmp_path, "export", uri, str(tmp_path / "out"))
    assert result.code == 1
    assert "s3ckpt export: error:" in result.err and "checksum" in result.err
    assert len(result.err.strip().splitlines()) == 1
    assert list((tmp_path / "out").iterdir()) == []  # what was written is gone


def test_existing_output_is_refused_unless_overwrite(
    cli, two_rank_checkpoint: str, tmp_path: Path
) -> None:
    (tmp_path / "model-00001-of-00009.safetensors").write_bytes(b"stale shard")
    (tmp_path / "README.md").write_text("kept")
    refused = cli("export", two_rank_checkpoint, str(tmp_path))
    assert refused.code == 2
    assert refused.err.strip() == (
        f"s3ckpt export: error: {tmp_path} exists and is not empty (pass --overwrite)"
    )
    done = cli("export", two_rank_checkpoint, str(tmp_path), "--overwrite")
    assert done.code == 0, done.err
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "README.md",
        "model.safetensors",
        "model.safetensors.index.json",
    ]
    with pytest.raises(OutputExistsError):
        export_checkpoint(two_rank_checkpoint, tmp_path, config=None)


def test_dtype_that_cannot_hold_the_values_warns(
    seaweedfs_s3: LocalS3Server, tmp_path: Path
) -> None:
    options = server_options(seaweedfs_s3)
    uri = f"s3://{seaweedfs_s3.bucket}/test_export-range-{secrets.token_hex(4)}"
    state = {"big": torch.tensor([1.0, 1e6, -3e38]), "small": torch.tensor([0.5, 2.0])}
    dcp.save(state, storage_writer=S3StorageWriter(uri, **options))
    result = _cli_runner.entry_point(
        seaweedfs_s3, tmp_path, "export", uri, str(tmp_path / "out"), "--dtype", "fp16"
    )
    assert result.code == 0, result.err
    assert result.err.strip() == (
        "s3ckpt export: warning: fp16 cannot hold values of 1 tensor(s) (first: big); "
        "they became inf"
    )
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(exported["small"], state["small"].half())
    assert torch.isinf(exported["big"][1:]).all()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--format", "onnx"], "unknown format 'onnx' (one of safetensors, torch)"),
        (["--dtype", "int4"], "unknown --dtype 'int4' (one of bf16, fp16, fp32)"),
        (["--only", "nothing"], "no tensor under --only 'nothing' (top-level names: model, optim)"),
    ],
)
def test_bad_options(
    cli, two_rank_checkpoint: str, tmp_path: Path, options: list[str], message: str
) -> None:
    result = cli("export", two_rank_checkpoint, str(tmp_path / "out"), *options)
    assert result.code == 2
    assert result.err.strip() == f"s3ckpt export: error: {message}"
    assert not (tmp_path / "out").exists()


def test_a_failed_export_to_s3_leaves_nothing(seaweedfs_s3: LocalS3Server) -> None:
    """The first tensor is half uploaded (one 64 MiB part of 70) when the second turns out
    damaged: the upload is aborted and the prefix stays empty."""
    options = server_options(seaweedfs_s3)
    base = f"s3://{seaweedfs_s3.bucket}/test_export-failed-{secrets.token_hex(4)}"
    state = {"a": torch.randn(70 * 1024 * 1024 // 4), "b": torch.randn(1000)}
    dcp.save(state, storage_writer=S3StorageWriter(f"{base}/ckpt", **options))
    location, client = S3URI.parse(f"{base}/ckpt"), seaweedfs_s3.client()
    (data,) = client.list_objects_v2(Bucket=location.bucket, Prefix=location.key("data/"))[
        "Contents"
    ]
    body = bytearray(client.get_object(Bucket=location.bucket, Key=data["Key"])["Body"].read())
    body[-1] ^= 0xFF  # the last bytes of the object are b's
    client.put_object(Bucket=location.bucket, Key=data["Key"], Body=bytes(body))
    with pytest.raises(CorruptCheckpointError, match="'b'"):
        export_checkpoint(f"{base}/ckpt", f"{base}/out", window=1, **options)
    out = S3URI.parse(f"{base}/out")
    assert client.list_objects_v2(Bucket=out.bucket, Prefix=out.key("")).get("KeyCount") == 0
    uploads = client.list_multipart_uploads(Bucket=out.bucket, Prefix=out.key(""))
    assert uploads.get("Uploads", []) == []


def test_an_overwrite_during_the_export_is_refused_not_mixed(
    seaweedfs_s3: LocalS3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint is overwritten (same names and shapes, other values) after the first
    window: the export fails rather than writing tensors of two saves into one output."""
    from s3ckpt.errors import CheckpointError
    from s3ckpt.interop import export as export_module

    options = server_options(seaweedfs_s3)
    uri = f"s3://{seaweedfs_s3.bucket}/test_export-overwritten-{secrets.token_hex(4)}"
    dcp.save(
        {"a": torch.ones(1000), "b": torch.ones(1000)},
        storage_writer=S3StorageWriter(uri, **options),
    )
    real = export_module.load_full
    windows: list[int] = []

    def then_overwrite(reader: Any, batch: Any) -> Any:
        loaded = real(reader, batch)
        if not windows:
            state = {"a": torch.zeros(1000), "b": torch.zeros(1000)}
            dcp.save(state, storage_writer=S3StorageWriter(uri, overwrite=True, **options))
        windows.append(len(batch))
        return loaded

    monkeypatch.setattr(export_module, "load_full", then_overwrite)
    with pytest.raises(CheckpointError, match="overwritten during the export"):
        export_checkpoint(uri, tmp_path / "out", window=1, **options)
    assert windows == [1, 1]  # one tensor per window: the second read the new save
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
