"""Every byte is checked: corruption is caught on load, and by the server on upload."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from stored import stored_manifest

from s3ckpt import CorruptCheckpointError, StorageError, catalog, unwrap
from s3ckpt.config import S3URI, make_config
from s3ckpt.format.manifest import Manifest
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore

MiB = 1024 * 1024


def _rewrite(local_s3, uri: str, relative_key: str, mutate) -> None:
    location = S3URI.parse(uri)
    client = local_s3.client()
    key = location.key(relative_key)
    body = bytearray(client.get_object(Bucket=location.bucket, Key=key)["Body"].read())
    mutate(body)
    client.put_object(Bucket=location.bucket, Key=key, Body=bytes(body))


def _manifest(local_s3, uri: str) -> Manifest:
    return stored_manifest(local_s3.client(), uri)


def test_a_flipped_byte_in_a_data_object_is_caught_and_named(
    local_s3, s3_prefix, make_writer, make_reader
):
    state = {"first": torch.arange(1000.0), "second": torch.arange(2000.0)}
    dcp.save(state, storage_writer=make_writer(s3_prefix))
    manifest = _manifest(local_s3, s3_prefix)
    second = next(item.stored for item in manifest.items if item.fqn == "second")

    def flip(body: bytearray) -> None:
        body[second.offset + 1234] ^= 0x40

    _rewrite(local_s3, s3_prefix, second.key, flip)
    with pytest.raises(BaseException) as info:
        dcp.load(
            {"first": torch.zeros(1000), "second": torch.zeros(2000)},
            storage_reader=make_reader(s3_prefix),
        )
    error = unwrap(info.value)
    assert isinstance(error, CorruptCheckpointError)
    assert second.key in str(error) and "'second'" in str(error)


def test_corruption_inside_a_large_tensor_is_caught_in_a_partial_read(
    local_s3, s3_prefix, make_writer, make_reader
):
    big = torch.randn(5 * MiB)  # 20 MiB: three checksum blocks
    dcp.save({"big": big}, storage_writer=make_writer(s3_prefix))
    manifest = _manifest(local_s3, s3_prefix)
    item = manifest.items[0].stored
    _rewrite(
        local_s3,
        s3_prefix,
        item.key,
        lambda b: b.__setitem__(item.offset + 17 * MiB, b[item.offset + 17 * MiB] ^ 1),
    )
    with pytest.raises(BaseException) as info:
        dcp.load(
            {"big": torch.zeros(5 * MiB)},
            storage_reader=make_reader(s3_prefix, request_size=5 * MiB),
        )
    assert isinstance(unwrap(info.value), CorruptCheckpointError)
    assert "block 2" in str(unwrap(info.value))


def test_tampered_metadata_is_refused(local_s3, s3_prefix, make_writer, make_reader):
    dcp.save({"a": torch.ones(3)}, storage_writer=make_writer(s3_prefix))
    manifest = _manifest(local_s3, s3_prefix)
    _rewrite(local_s3, s3_prefix, manifest.metadata_key, lambda b: b.__setitem__(10, b[10] ^ 0xFF))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        make_reader(s3_prefix).read_metadata()


def test_a_missing_metadata_object_is_a_damaged_checkpoint(
    local_s3, s3_prefix, make_writer, make_reader
):
    dcp.save({"a": torch.ones(3)}, storage_writer=make_writer(s3_prefix))
    manifest = _manifest(local_s3, s3_prefix)
    location = S3URI.parse(s3_prefix)
    local_s3.client().delete_object(Bucket=location.bucket, Key=location.key(manifest.metadata_key))
    with pytest.raises(CorruptCheckpointError, match="metadata object is missing"):
        make_reader(s3_prefix).read_metadata()


def test_a_load_racing_an_overwrite_reads_the_newer_checkpoint(
    local_s3, s3_prefix, s3_options, make_writer, make_reader, monkeypatch
):
    # The reader reads the old manifest; the overwrite then commits and gc removes the old
    # save's metadata before the reader fetches it: the reader follows the new commit.
    from s3ckpt.dcp import metadata_read

    dcp.save({"a": torch.full((10,), 1.0)}, storage_writer=make_writer(s3_prefix))
    old = _manifest(local_s3, s3_prefix)
    dcp.save({"a": torch.full((10,), 2.0)}, storage_writer=make_writer(s3_prefix, overwrite=True))
    _collect_the_replaced_save(s3_options, s3_prefix)
    real = metadata_read.read_manifest
    calls = []

    async def stale_first(store, location):
        calls.append(location)
        return old if len(calls) == 1 else await real(store, location)

    monkeypatch.setattr(metadata_read, "read_manifest", stale_first)
    restored = {"a": torch.zeros(10)}
    dcp.load(restored, storage_reader=make_reader(s3_prefix))
    assert torch.equal(restored["a"], torch.full((10,), 2.0))
    assert len(calls) == 2


def _collect_the_replaced_save(s3_options, uri: str) -> None:
    report = catalog.collect_garbage(uri, grace=0, config=make_config_for(s3_options))
    assert [g.reason for g in report.garbage] == ["unreferenced"]


def test_a_load_whose_data_objects_vanish_starts_over_on_the_newer_save(
    local_s3, s3_prefix, s3_options, make_writer, make_reader, monkeypatch
):
    """Between planning and reading, an overwrite commits and gc removes the old save's
    objects: the load reads every item again from the newer save, never a mix."""
    state = {"a": torch.full((1000,), 1.0), "b": torch.full((10,), 1.0)}
    dcp.save(state, storage_writer=make_writer(s3_prefix))
    reader = make_reader(s3_prefix)
    real_read_data = type(reader).read_data

    def overwritten_first(self, plan, planner):
        newer = {"a": torch.full((1000,), 2.0), "b": torch.full((10,), 2.0)}
        dcp.save(newer, storage_writer=make_writer(s3_prefix, overwrite=True))
        _collect_the_replaced_save(s3_options, s3_prefix)
        monkeypatch.setattr(type(reader), "read_data", real_read_data)
        return real_read_data(self, plan, planner)

    monkeypatch.setattr(type(reader), "read_data", overwritten_first)
    restored = {"a": torch.zeros(1000), "b": torch.zeros(10)}
    dcp.load(restored, storage_reader=reader)
    assert torch.equal(restored["a"], torch.full((1000,), 2.0))
    assert torch.equal(restored["b"], torch.full((10,), 2.0))
    assert (
        reader.manifest is not None
        and reader.manifest.save_id == _manifest(local_s3, s3_prefix).save_id
    )


def test_a_truncated_object_fails_the_load(local_s3, s3_prefix, make_writer, make_reader):
    dcp.save({"a": torch.arange(4096.0)}, storage_writer=make_writer(s3_prefix))
    manifest = _manifest(local_s3, s3_prefix)
    _rewrite(
        local_s3,
        s3_prefix,
        manifest.items[0].stored.key,
        lambda b: b.__delitem__(slice(8000, None)),
    )
    with pytest.raises(BaseException) as info:
        dcp.load({"a": torch.zeros(4096)}, storage_reader=make_reader(s3_prefix))
    assert isinstance(unwrap(info.value), (StorageError, CorruptCheckpointError))


def test_the_server_rejects_a_part_whose_checksum_does_not_match(local_s3, s3_prefix, s3_options):
    # BadDigest is retried (bytes damaged in transit); two tries show the refusal without
    # waiting out the backoff of ten (about a minute).
    store = ObjectStore(make_config_for({**s3_options, "max_attempts": 2}), local_s3.bucket)
    key = S3URI.parse(s3_prefix).key("data/bad-part.bin")
    loop = io_loop()
    upload_id = loop.run(store.create_multipart(key))
    try:
        with pytest.raises(StorageError) as info:
            loop.run(store.upload_part(key, upload_id, 1, b"x" * (5 * MiB), crc32c=12345))
        assert info.value.code == "BadDigest"
    finally:
        loop.run(store.abort_multipart(key, upload_id))
    with pytest.raises(StorageError):
        loop.run(store.put(key, b"payload", crc32c=1))
    assert not loop.run(store.exists(key))


def make_config_for(options):
    from s3ckpt.config import make_config

    return make_config(None, **options)


@pytest.mark.parametrize("damage", ["flipped", "missing"])
def test_a_damaged_index_object_fails_the_load_and_shows_in_verify(
    local_s3, s3_prefix, make_writer, make_reader, s3_options, damage
):
    dcp.save({"a": torch.ones(300), "b": torch.zeros(5)}, storage_writer=make_writer(s3_prefix))
    manifest = _manifest(local_s3, s3_prefix)
    (ref,) = manifest.indexes
    location = S3URI.parse(s3_prefix)
    if damage == "flipped":
        _rewrite(local_s3, s3_prefix, ref.key, lambda b: b.__setitem__(5, b[5] ^ 0x20))
    else:
        local_s3.client().delete_object(Bucket=location.bucket, Key=location.key(ref.key))
    with pytest.raises(BaseException) as info:
        dcp.load({"a": torch.zeros(300), "b": torch.ones(5)}, storage_reader=make_reader(s3_prefix))
    error = unwrap(info.value)
    assert isinstance(error, CorruptCheckpointError), error
    assert ref.key in str(error)
    report = catalog.verify_checkpoint(s3_prefix, config=make_config(None, **s3_options))
    assert not report.ok and report.items == 2
    (problem,) = report.problems
    assert problem.what == "index" and problem.key == ref.key
    assert ("missing" if damage == "missing" else "checksum mismatch") in problem.message
    assert "2 items of rank 0 unchecked" in problem.message
    with pytest.raises(CorruptCheckpointError, match="index"):  # show: exit status 1
        catalog.show_checkpoint(s3_prefix, config=make_config(None, **s3_options))
