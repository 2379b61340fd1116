"""The catalog API against the real local server: list, show, verify, prune, gc, rm."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from paused_save import PausedSave

from s3ckpt import catalog
from s3ckpt.catalog import pruning as catalog_pruning
from s3ckpt.catalog.api import remove_groups
from s3ckpt.catalog.gc import acollect_garbage
from s3ckpt.catalog.reporting import SILENT
from s3ckpt.catalog.scan import scan
from s3ckpt.config import S3URI, make_config
from s3ckpt.errors import CheckpointNotFoundError
from s3ckpt.format.manifest import MANIFEST_NAME
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore

HOUR = 3600.0


def _state(value: float = 1.0) -> dict[str, object]:
    return {
        "w": torch.full((256,), value),
        "b": torch.arange(8, dtype=torch.int64),
        "meta": {"v": value},
    }


class InFlight(PausedSave):
    """A save whose data is uploaded but whose commit waits until :meth:`release`."""

    def __init__(self, make_writer, uri: str, value: float = 9.0) -> None:
        self.uri = uri
        super().__init__(make_writer(uri), _state(value), timeout_s=60)


def _failed_save(make_writer, uri: str) -> None:
    writer = make_writer(uri)

    def finish(metadata, results):
        raise RuntimeError("coordinator died")

    writer.finish = finish  # type: ignore[method-assign]
    with pytest.raises(BaseException, match="coordinator died"):
        dcp.save(_state(), storage_writer=writer)


def _loads(make_reader, uri: str, value: float) -> bool:
    restored = {"w": torch.zeros(256), "b": torch.zeros(8, dtype=torch.int64), "meta": {"v": 0.0}}
    dcp.load(restored, storage_reader=make_reader(uri))
    return bool(torch.equal(restored["w"], torch.full((256,), value)))


@pytest.fixture
def opts(s3_options):
    return {"config": make_config(None, **s3_options)}


def test_list_orders_naturally_and_marks_uncommitted_saves(
    s3_prefix, make_writer, opts, monkeypatch
):
    for name in ("step-10", "step-9", "step-100"):
        dcp.save(_state(), storage_writer=make_writer(f"{s3_prefix}/{name}"))
    _failed_save(make_writer, f"{s3_prefix}/step-200")
    requests: list[str] = []
    for method in ("get", "head"):
        original = getattr(ObjectStore, method)
        monkeypatch.setattr(
            ObjectStore,
            method,
            lambda self, key, _o=original, _m=method: requests.append(_m) or _o(self, key),
        )

    committed = catalog.list_checkpoints(s3_prefix, **opts)
    assert [c.name for c in committed] == ["step-9", "step-10", "step-100"]
    assert requests == []  # the listing alone: no request per checkpoint
    assert all(c.committed and c.ranks == 1 and c.items is None for c in committed)
    assert committed[0].uri == f"{s3_prefix}/step-9"

    everything = catalog.list_checkpoints(s3_prefix, include_uncommitted=True, details=True, **opts)
    assert [(c.name, c.committed) for c in everything][-1] == ("step-200", False)
    manifest = catalog.show_checkpoint(f"{s3_prefix}/step-9", **opts)
    details = everything[0]
    assert details.items == len(manifest.items) == 3 and details.save_id == manifest.save_id
    assert details.bytes == manifest.total_bytes + len(manifest.to_json())
    assert everything[-1].bytes > 0 and everything[-1].items is None


def test_show_and_rm_of_a_missing_checkpoint(s3_prefix, opts):
    with pytest.raises(CheckpointNotFoundError):
        catalog.show_checkpoint(f"{s3_prefix}/nothing", **opts)
    with pytest.raises(CheckpointNotFoundError):
        catalog.remove_checkpoint(f"{s3_prefix}/nothing", **opts)


def test_rm_deletes_the_manifest_and_what_it_lists(s3_prefix, make_writer, list_keys, opts):
    uri = f"{s3_prefix}/step-1"
    dcp.save(_state(), storage_writer=make_writer(uri))
    keys = list_keys(uri)
    removed = catalog.remove_checkpoint(uri, **opts)
    assert removed.objects == len(keys) and list_keys(uri) == []
    assert catalog.list_checkpoints(s3_prefix, include_uncommitted=True, **opts) == []


def test_verify_reports_every_damaged_item(local_s3, s3_prefix, make_writer, opts):
    uri = f"{s3_prefix}/step-1"
    state = {"first": torch.arange(1000.0), "second": torch.arange(2000.0), "third": torch.ones(9)}
    dcp.save(state, storage_writer=make_writer(uri))
    assert catalog.verify_checkpoint(uri, **opts).ok
    manifest = catalog.show_checkpoint(uri, **opts)
    items = {i.fqn: i.stored for i in manifest.items}
    location, client = S3URI.parse(uri), local_s3.client()
    key = location.key(items["second"].key)
    body = bytearray(client.get_object(Bucket=location.bucket, Key=key)["Body"].read())
    body[items["second"].offset + 5] ^= 0x01
    body[items["first"].offset + 4000 - 1] ^= 0x80
    client.put_object(Bucket=location.bucket, Key=key, Body=bytes(body))

    report = catalog.verify_checkpoint(uri, max_buffer=4096, **opts)  # several batches
    assert not report.ok and report.items == 3
    assert sorted(p.what for p in report.problems) == ["first", "second"]
    assert all("checksum mismatch in block 0" in p.message for p in report.problems)

    client.put_object(Bucket=location.bucket, Key=key, Body=bytes(body[:-10]))
    report = catalog.verify_checkpoint(uri, **opts)
    assert len(report.problems) == 3
    assert all(
        p.message == f"object is {len(body) - 10} bytes, expected {len(body)}"
        for p in report.problems
    )

    client.delete_object(Bucket=location.bucket, Key=key)
    report = catalog.verify_checkpoint(uri, **opts)
    assert {p.what for p in report.problems} == {"first", "second", "third"}
    assert all(p.message == "object missing" for p in report.problems)


def test_verify_reads_a_large_item_in_pieces_within_its_buffer(
    local_s3, s3_prefix, make_writer, opts
):
    uri = f"{s3_prefix}/step-1"
    dcp.save({"big": torch.randn(5 * 1024 * 1024)}, storage_writer=make_writer(uri))  # 20 MiB
    item = catalog.show_checkpoint(uri, **opts).items[0].stored
    location, client = S3URI.parse(uri), local_s3.client()
    key = location.key(item.key)
    body = bytearray(client.get_object(Bucket=location.bucket, Key=key)["Body"].read())
    body[item.offset + 17 * 1024 * 1024] ^= 0x01
    client.put_object(Bucket=location.bucket, Key=key, Body=bytes(body))
    report = catalog.verify_checkpoint(uri, max_buffer=8 * 1024 * 1024, **opts)
    assert [p.message.split(" (")[0] for p in report.problems] == ["checksum mismatch in block 2"]
    manifest = catalog.show_checkpoint(uri, **opts)
    indexes = sum(i.size for i in manifest.indexes)
    assert report.bytes == item.length + manifest.metadata_size + indexes


def test_prune_never_touches_a_save_in_flight_or_one_committing_meanwhile(
    s3_prefix, make_writer, make_reader, list_keys, opts, monkeypatch
):
    for step in (1, 2):
        dcp.save(_state(step), storage_writer=make_writer(f"{s3_prefix}/step-{step}"))
    committing = InFlight(make_writer, f"{s3_prefix}/step-3", 3.0)  # commits during the prune
    in_flight = InFlight(make_writer, f"{s3_prefix}/step-4", 4.0)  # commits after it
    in_flight_keys = list_keys(in_flight.uri)

    real_scan = catalog_pruning.scan_checkpoints

    async def scan_then_commit(store, location):
        listing = await real_scan(store, location)
        await asyncio.to_thread(committing.release)  # commits after the listing, mid-prune
        return listing

    monkeypatch.setattr(catalog_pruning, "scan_checkpoints", scan_then_commit)
    report = catalog.prune(s3_prefix, keep_last=1, **opts)
    assert [r.name for r in report.removed] == ["step-1"]
    assert [(d.name, d.reason) for d in report.decisions if not d.delete] == [("step-2", "newest")]
    assert list_keys(in_flight.uri) == in_flight_keys
    in_flight.release()
    names = [c.name for c in catalog.list_checkpoints(s3_prefix, include_uncommitted=True, **opts)]
    assert names == ["step-2", "step-3", "step-4"]
    for step in (2, 3, 4):
        assert _loads(make_reader, f"{s3_prefix}/step-{step}", float(step))
        assert catalog.verify_checkpoint(f"{s3_prefix}/step-{step}", **opts).ok


def test_prune_leaves_a_checkpoint_recommitted_after_the_listing(
    s3_prefix, make_writer, make_reader, store
):
    uri = f"{s3_prefix}/step-1"
    dcp.save(_state(1.0), storage_writer=make_writer(uri))
    location = S3URI.parse(s3_prefix)
    stale = io_loop().run(scan(store, location)).groups["step-1"]
    dcp.save(_state(2.0), storage_writer=make_writer(uri, overwrite=True))
    removed, changed = io_loop().run(remove_groups(store, location, [stale], SILENT))
    assert removed == [] and changed == ["step-1"]
    assert _loads(make_reader, uri, 2.0)


def test_prune_policy_and_dry_run(s3_prefix, make_writer, opts, list_keys):
    for step in (100, 200, 300, 400):
        dcp.save(_state(), storage_writer=make_writer(f"{s3_prefix}/step-{step}"))
    before = list_keys(s3_prefix)
    dry = catalog.prune(s3_prefix, keep_last=1, keep_every=200, dry_run=True, **opts)
    assert [r.name for r in dry.removed] == ["step-100", "step-300"] and dry.dry_run
    assert list_keys(s3_prefix) == before
    assert catalog.prune(s3_prefix, keep_last=0, older_than=HOUR, **opts).removed == []
    catalog.prune(s3_prefix, keep_last=0, **opts)
    assert [c.name for c in catalog.list_checkpoints(s3_prefix, **opts)] == ["step-400"]
    catalog.prune(s3_prefix, keep_last=0, force=True, **opts)
    assert list_keys(s3_prefix) == []


def test_gc_leaves_a_save_inside_its_grace_period_untouched(
    local_s3, s3_prefix, make_writer, make_reader, store, list_keys, pending_uploads
):
    location = S3URI.parse(s3_prefix)
    dcp.save(_state(1.0), storage_writer=make_writer(f"{s3_prefix}/step-1"))
    _failed_save(make_writer, f"{s3_prefix}/step-2")
    in_flight = InFlight(make_writer, f"{s3_prefix}/step-3", 3.0)
    rank1 = location.key("step-3/data/r00001-00000000000000ff-0000.bin")
    local_s3.client().create_multipart_upload(Bucket=location.bucket, Key=rank1)
    before = list_keys(s3_prefix)

    report = io_loop().run(acollect_garbage(store, location))  # grace 1h: all of it is recent
    assert report.garbage == [] and report.uploads == []
    assert list_keys(s3_prefix) == before and pending_uploads(s3_prefix) == [rank1]
    in_flight.release()
    assert _loads(make_reader, f"{s3_prefix}/step-3", 3.0)


def test_an_upload_started_inside_the_grace_period_protects_its_directory(
    local_s3, s3_prefix, make_writer, store
):
    location = S3URI.parse(s3_prefix)
    client = local_s3.client()
    _failed_save(make_writer, f"{s3_prefix}/step-2")
    stale = location.key("step-9/data/r00000-00000000000000aa-0000.bin")
    client.create_multipart_upload(Bucket=location.bucket, Key=stale)
    time.sleep(1.1)  # past the second that stamps it: the next upload's stamp differs
    fresh = location.key("step-2/data/r00001-00000000000000bb-0000.bin")
    client.create_multipart_upload(Bucket=location.bucket, Key=fresh)  # a rank still uploading
    listed = client.list_multipart_uploads(Bucket=location.bucket, Prefix=location.prefix + "/")
    initiated = {u["Key"]: u["Initiated"].timestamp() for u in listed["Uploads"]}
    assert initiated[fresh] - initiated[stale] >= 1.0, initiated
    # ``now`` from the server's stamps, not this machine's clock: the fresh upload is 0.5 s
    # old, inside the grace of 1 s, and the stale one at least 1.5 s, however slow the test.
    now = initiated[fresh] + 0.5
    report = io_loop().run(acollect_garbage(store, location, grace=1.0, dry_run=True, now=now))
    assert [u.key for u in report.uploads] == [stale]
    assert report.garbage == []


def test_gc_removes_stale_uploads_uncommitted_saves_orphans_and_probes(
    local_s3, s3_prefix, make_writer, make_reader, store, list_keys, pending_uploads
):
    location = S3URI.parse(s3_prefix)
    dcp.save(_state(1.0), storage_writer=make_writer(f"{s3_prefix}/step-1"))
    committed = list_keys(f"{s3_prefix}/step-1")
    _failed_save(make_writer, f"{s3_prefix}/step-2")
    client = local_s3.client()
    orphan = location.key("step-1/data/r00001-00000000000000aa-0000.bin")
    client.put_object(Bucket=location.bucket, Key=orphan, Body=b"x" * 100)
    client.put_object(
        Bucket=location.bucket, Key=location.key("step-1/.s3ckpt-probe-abc"), Body=b"1"
    )
    client.put_object(Bucket=location.bucket, Key=location.key("notes.txt"), Body=b"mine")
    client.create_multipart_upload(
        Bucket=location.bucket, Key=location.key("step-5/data/r00000-00000000000000bb-0000.bin")
    )

    report = io_loop().run(acollect_garbage(store, location, now=time.time() + 2 * HOUR))
    assert [u.key.rpartition("/")[2] for u in report.uploads] == [
        "r00000-00000000000000bb-0000.bin"
    ]
    reasons = {(g.name, g.reason) for g in report.garbage}
    assert reasons == {("step-2", "uncommitted"), ("step-1", "unreferenced"), ("step-1", "probe")}
    assert pending_uploads(s3_prefix) == []
    assert list_keys(s3_prefix) == ["notes.txt", *[f"step-1/{k}" for k in committed]]
    assert _loads(make_reader, f"{s3_prefix}/step-1", 1.0)
    assert MANIFEST_NAME in list_keys(f"{s3_prefix}/step-1")


def test_a_save_that_died_inside_its_first_upload_is_listed_with_all(s3_prefix, store, opts):
    """Only an open multipart upload is left: no object, but ls --all must still show it."""
    location = S3URI.parse(f"{s3_prefix}/step-7")
    key = location.key("data/r00000-0123456789abcdef-0000.bin")
    upload_id = io_loop().run(store.create_multipart(key))
    try:
        assert catalog.list_checkpoints(s3_prefix, **opts) == []
        (dead,) = catalog.list_checkpoints(s3_prefix, include_uncommitted=True, **opts)
        assert (dead.name, dead.committed, dead.uploads, dead.bytes) == ("step-7", False, 1, 0)
        assert time.time() - dead.time < 300
    finally:
        io_loop().run(store.abort_multipart(key, upload_id))
