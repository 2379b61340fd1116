"""``s3ckpt cp``: within a bucket, across buckets and across endpoints (SeaweedFS to moto),
server-side or streamed, verified, committed last; failures leave the destination clean."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist_worker import server_options
from s3_servers import MotoS3Server

from s3ckpt import S3StorageReader, S3StorageWriter
from s3ckpt.config import S3URI, S3Config
from s3ckpt.errors import CorruptCheckpointError
from s3ckpt.format.manifest import MANIFEST_NAME
from s3ckpt.interop import copy_checkpoint
from s3ckpt.testing.local_s3 import LocalS3Server


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(3 * 1024 * 1024, generator=g),  # 12 MiB: a multipart data object
        "e": torch.randn(31, 7, generator=g).to(torch.bfloat16),
        "step": 42,
    }


def keys(server: Any, uri: str) -> dict[str, int]:
    """Every object under ``uri`` with its size, keys relative to it."""
    location = S3URI.parse(uri)
    pages = server.client().get_paginator("list_objects_v2")
    found: dict[str, int] = {}
    for page in pages.paginate(Bucket=location.bucket, Prefix=location.key("")):
        found.update(
            {i["Key"][len(location.key("")) :]: i["Size"] for i in page.get("Contents", [])}
        )
    return found


def same_objects(server: Any, uri: str, source_server: Any, source: str) -> None:
    """The copy holds the source's objects under the same keys and sizes; the manifests
    differ only in the ETags they record."""
    copied, original = keys(server, uri), keys(source_server, source)
    assert copied.pop(MANIFEST_NAME) and original.pop(MANIFEST_NAME)
    assert copied == original


def parts_of_largest(server: Any, uri: str) -> str:
    """The ETag of the largest object under ``uri``: ``"...-N"`` for an N-part upload."""
    location = S3URI.parse(uri)
    name = max(keys(server, uri).items(), key=lambda item: item[1])[0]
    return server.client().head_object(Bucket=location.bucket, Key=location.key(name))["ETag"]


def assert_loads(uri: str, server: Any) -> None:
    expected = state()
    loaded = {"w": torch.zeros_like(expected["w"]), "e": torch.zeros_like(expected["e"]), "step": 0}
    dcp.load(loaded, storage_reader=S3StorageReader(uri, **server_options(server)))
    assert torch.equal(loaded["w"], expected["w"]) and torch.equal(loaded["e"], expected["e"])
    assert loaded["step"] == 42


@pytest.fixture
def source(seaweedfs_s3: LocalS3Server) -> str:
    uri = f"s3://{seaweedfs_s3.bucket}/test_copy-{secrets.token_hex(4)}/run/step-42"
    dcp.save(state(), storage_writer=S3StorageWriter(uri, **server_options(seaweedfs_s3)))
    return uri


def test_within_a_bucket_server_side(cli, source: str, seaweedfs_s3: LocalS3Server) -> None:
    destination = source.replace("/run/", "/copied/")
    result = cli("cp", source, destination, "--json")
    assert result.code == 0, result.err
    report = result.json()
    assert (
        report["server_side"] is True and report["objects"] == len(keys(seaweedfs_s3, source)) - 1
    )
    same_objects(seaweedfs_s3, destination, seaweedfs_s3, source)
    assert_loads(destination, seaweedfs_s3)
    verified = cli("verify", destination)
    assert verified.code == 0, verified.err


def test_across_buckets_and_objects_over_the_copy_limit(
    source: str, seaweedfs_s3: LocalS3Server
) -> None:
    """A second bucket on the same endpoint; objects over the CopyObject limit (lowered
    here to 1 byte) go by UploadPartCopy, the 12 MiB data object in three 5 MiB parts."""
    bucket = f"copy-{secrets.token_hex(4)}"
    seaweedfs_s3.client().create_bucket(Bucket=bucket)
    destination = f"s3://{bucket}/imported/step-42"
    report = copy_checkpoint(
        source,
        destination,
        copy_object_limit=1,
        part_size=5 * 2**20,
        **server_options(seaweedfs_s3),
    )
    assert report.server_side
    assert parts_of_largest(seaweedfs_s3, destination).endswith('-3"')  # 5 + 5 + 2 MiB
    same_objects(seaweedfs_s3, destination, seaweedfs_s3, source)
    assert_loads(destination, seaweedfs_s3)


def test_across_endpoints_streamed(
    cli, source: str, seaweedfs_s3: LocalS3Server, moto_s3: MotoS3Server
) -> None:
    destination = f"s3://{moto_s3.bucket}/from-seaweedfs-{secrets.token_hex(4)}/step-42"
    result = cli("cp", source, destination, "--to-endpoint-url", moto_s3.endpoint_url)
    assert result.code == 0, result.err
    assert "streamed; verified" in result.out
    same_objects(moto_s3, destination, seaweedfs_s3, source)
    assert_loads(destination, moto_s3)


def test_across_endpoints_in_parts(
    source: str, seaweedfs_s3: LocalS3Server, moto_s3: MotoS3Server
) -> None:
    """Objects larger than a part are streamed through part by part (5 MiB here), each
    part with its CRC32C."""
    destination = f"s3://{moto_s3.bucket}/parts-{secrets.token_hex(4)}/step-42"
    report = copy_checkpoint(
        source,
        destination,
        part_size=5 * 2**20,
        destination_config=S3Config(**server_options(moto_s3)),
        **server_options(seaweedfs_s3),
    )
    assert not report.server_side and report.verified_bytes >= 12 * 2**20
    assert parts_of_largest(moto_s3, destination).endswith('-3"')  # 5 + 5 + 2 MiB
    same_objects(moto_s3, destination, seaweedfs_s3, source)
    assert_loads(destination, moto_s3)


def test_overwrite(cli, source: str, seaweedfs_s3: LocalS3Server) -> None:
    destination = source.replace("/run/", "/other/")
    dcp.save(
        {"x": torch.ones(3)},
        storage_writer=S3StorageWriter(destination, **server_options(seaweedfs_s3)),
    )
    refused = cli("cp", source, destination)
    assert refused.code == 1
    assert refused.err.strip() == (
        f"s3ckpt cp: error: a checkpoint is already committed at {destination} "
        "(pass --overwrite to replace it)"
    )
    replaced = cli("cp", source, destination, "--overwrite")
    assert replaced.code == 0, replaced.err
    assert_loads(destination, seaweedfs_s3)
    again = cli("cp", source, destination, "--overwrite")
    assert again.code == 1 and "already holds this checkpoint" in again.err


def test_uncommitted_source(cli, source: str) -> None:
    result = cli("cp", f"{source}-missing", source.replace("/run/", "/x/"))
    assert result.code == 1
    assert result.err.strip() == f"s3ckpt cp: error: no committed checkpoint at {source}-missing"


def test_damaged_source_fails_verification_and_leaves_nothing(
    source: str, seaweedfs_s3: LocalS3Server
) -> None:
    location, client = S3URI.parse(source), seaweedfs_s3.client()
    data = [k for k in keys(seaweedfs_s3, source) if k.startswith("data/")]
    body = bytearray(
        client.get_object(Bucket=location.bucket, Key=location.key(data[0]))["Body"].read()
    )
    body[len(body) // 2] ^= 0x01
    client.put_object(Bucket=location.bucket, Key=location.key(data[0]), Body=bytes(body))
    destination = source.replace("/run/", "/damaged-copy/")
    with pytest.raises(
        CorruptCheckpointError, match=r"failed verification .* nothing was committed"
    ):
        copy_checkpoint(source, destination, **server_options(seaweedfs_s3))
    assert keys(seaweedfs_s3, destination) == {}


def test_in_flight_record_while_copying(
    source: str, seaweedfs_s3: LocalS3Server, monkeypatch
) -> None:
    """gc and prune see the copy as a save in flight until its commit, and the record is
    gone afterwards."""
    from s3ckpt.interop import copy as copy_module

    destination = source.replace("/run/", "/watched/")
    seen: list[list[str]] = []
    real = copy_module.commit_manifest

    async def watching(store, location, manifest, *, overwrite):
        seen.append(sorted(keys(seaweedfs_s3, destination)))
        await real(store, location, manifest, overwrite=overwrite)

    monkeypatch.setattr(copy_module, "commit_manifest", watching)
    copy_checkpoint(source, destination, **server_options(seaweedfs_s3))
    assert any(k.startswith(".s3ckpt-saving-") for k in seen[0])
    assert MANIFEST_NAME not in seen[0]
    assert not any(k.startswith(".s3ckpt-saving-") for k in keys(seaweedfs_s3, destination))
