"""Maintenance never deletes what a save has just committed or is writing:

* on a store that ignores ``If-Match`` on DELETE (the fault proxy strips the header, as
  some stores do), ``prune`` and ``rm`` re-check a manifest just before deleting it, and a
  checkpoint recommitted after their listing survives and loads;
* ``gc`` and ``prune`` measure ages with the store's clock, so a host whose clock is two
  hours off neither collects a running save nor keeps a dead one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import reliability_report as reliability
import torch
import torch.distributed.checkpoint as dcp
from faultproxy import FaultProxy
from paused_save import PausedSave

from s3ckpt import catalog
from s3ckpt.catalog import pruning as catalog_pruning
from s3ckpt.catalog import unpublish as unpublish_module
from s3ckpt.catalog.gc import acollect_garbage
from s3ckpt.catalog.scan import scan_checkpoints, timestamp
from s3ckpt.catalog.unpublish import conditional_deletes, probe_conditional_delete
from s3ckpt.cli.main import main
from s3ckpt.config import S3URI, make_config
from s3ckpt.dcp import save_commit as save_commit_module
from s3ckpt.format.layout import saving_key
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.inflight import mark_in_flight

SKEWS = (2 * 3600.0, -2 * 3600.0)  # a local clock two hours ahead, then two hours behind
MATRIX_ROWS = 5


@pytest.fixture(scope="module")
def matrix():
    """Rows of the fault matrix (``make reliability-report`` renders them)."""
    yield from reliability.filled(
        "maintenance",
        MATRIX_ROWS,
        notes=[
            "Against SeaweedFS through the fault proxy; where conditional deletes are "
            "ignored, the proxy strips If-Match and signs the request again. Survived: the "
            "newest commit (or the running save) was kept and loads bit-exact; what was due "
            "for deletion was deleted.",
        ],
    )


def _row(matrix, scenario: str, faults: dict[str, int]) -> None:
    matrix.add(reliability.Row(scenario, faults, operations=1, survived=1))


def _state(value: float) -> dict[str, object]:
    return {"w": torch.full((64,), value), "meta": {"v": value}}


def _loads(make_reader, uri: str, value: float) -> bool:
    restored = {"w": torch.zeros(64), "meta": {"v": 0.0}}
    dcp.load(restored, storage_reader=make_reader(uri))
    return bool(torch.equal(restored["w"], torch.full((64,), value))) and restored["meta"] == {
        "v": value
    }


@pytest.fixture
def ignoring(local_s3):
    """The fault proxy in front of the server, dropping conditional headers."""
    with FaultProxy(
        local_s3.endpoint_url, conditional="ignore", secret_key=local_s3.secret_key
    ) as proxy:
        yield proxy


@pytest.fixture
def through(s3_options, ignoring) -> dict[str, Any]:
    """Catalog options that go through the proxy."""
    return {"config": make_config(None, **{**s3_options, "endpoint_url": ignoring.endpoint_url})}


@pytest.fixture
def two_steps(s3_prefix, make_writer) -> None:
    """``step-1`` and ``step-2`` committed under the test's prefix, holding 1.0 and 2.0."""
    for step in (1, 2):
        dcp.save(_state(step), storage_writer=make_writer(f"{s3_prefix}/step-{step}"))


def _then_recommit(real, make_writer, uri: str | None = None):
    """``real(store, location)``, after which ``uri`` (by default the checkpoint at
    ``location``) is committed again, holding 10.0: what ``real`` read is then stale."""

    async def wrapped(store, location):
        result = await real(store, location)
        overwrite = make_writer(uri or str(location), overwrite=True)
        await asyncio.to_thread(dcp.save, _state(10.0), storage_writer=overwrite)
        return result

    return wrapped


@pytest.fixture
def cli_env(local_s3, monkeypatch):
    for name, value in local_s3.env().items():
        monkeypatch.setenv(name, value)


class HeldCommit:
    """An overwrite held after its metadata object is written, before its manifest: the
    last moment a listing can take it for the committed save."""

    def __init__(self, monkeypatch) -> None:
        self.reached, self._go = threading.Event(), threading.Event()
        real = save_commit_module.commit_manifest

        async def held(*args, **kwargs):
            self.reached.set()
            while not self._go.is_set():
                await asyncio.sleep(0.02)  # the I/O loop serves the test's prune meanwhile
            return await real(*args, **kwargs)

        monkeypatch.setattr(save_commit_module, "commit_manifest", held)

    def save(self, writer, value: float) -> threading.Thread:
        self.reached.clear()
        self._go.clear()
        failed: list[BaseException] = []

        def run() -> None:
            try:
                dcp.save(_state(value), storage_writer=writer)
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert self.reached.wait(120), failed
        thread.failed = failed  # type: ignore[attr-defined]
        return thread

    def release(self, thread: threading.Thread) -> None:
        self._go.set()
        thread.join(120)
        assert not thread.failed, thread.failed  # type: ignore[attr-defined]


def test_prune_keeps_a_checkpoint_whose_overwrite_commits_in_the_second_of_its_last_commit(
    s3_prefix, make_writer, make_reader, store, monkeypatch
):
    """Overwrites of step-1 follow each other, each held between its metadata object and
    its manifest; each starts right after the previous commit, so on most attempts its
    record and metadata object share the commit's second (``LastModified`` has whole
    seconds), where the newest metadata before the commit is the overwrite's, not the
    committed save's. Every attempt, same second or not, prune keeps step-1 as a save in
    flight; the listing of that second itself is pinned in
    ``tests/unit/catalog/test_scan_in_flight.py``."""
    location = S3URI.parse(s3_prefix)
    dcp.save(_state(1), storage_writer=make_writer(f"{s3_prefix}/step-1"))
    dcp.save(_state(2), storage_writer=make_writer(f"{s3_prefix}/step-2"))
    hold = HeldCommit(monkeypatch)
    seconds_shared = 0
    for attempt in range(4):
        value = 10.0 + attempt
        thread = hold.save(make_writer(f"{s3_prefix}/step-1", overwrite=True), value)
        try:
            step1 = io_loop().run(scan_checkpoints(store, location)).groups["step-1"]
            assert step1.manifest is not None
            newest = max(timestamp(o.meta) for o in step1.objects if o.rank is None)
            seconds_shared += newest == timestamp(step1.manifest)
            report = io_loop().run(
                catalog_pruning.aprune(store, location, keep_last=0, force=True, dry_run=True)
            )
        finally:
            hold.release(thread)
        kept = {d.name: d.reason for d in report.decisions if not d.delete}
        assert kept == {"step-1": "save in flight"}, (attempt, seconds_shared)
        assert [r.name for r in report.removed] == ["step-2"]
        assert _loads(make_reader, f"{s3_prefix}/step-1", value)


def test_the_probe_sees_which_stores_honour_conditional_deletes(
    s3_options, local_s3, s3_prefix, list_keys
):
    location = S3URI.parse(s3_prefix)
    seen = {}
    for mode in ("pass", "ignore", "reject"):
        with FaultProxy(
            local_s3.endpoint_url, conditional=mode, secret_key=local_s3.secret_key
        ) as proxy:
            config = make_config(None, **{**s3_options, "endpoint_url": proxy.endpoint_url})
            store = ObjectStore(config, local_s3.bucket)
            probe = location.key(f"probe-{mode}")
            seen[mode] = io_loop().run(probe_conditional_delete(store, probe))
            assert io_loop().run(conditional_deletes(store, location)) is seen[mode][0]
    assert seen["pass"][0] and "honoured" in seen["pass"][1]
    assert not seen["ignore"][0] and "ignored" in seen["ignore"][1]
    assert not seen["reject"][0] and "refused (NotImplemented)" in seen["reject"][1]
    assert list_keys(s3_prefix) == []  # the probe objects are gone


def test_prune_keeps_a_checkpoint_recommitted_after_its_listing(
    s3_prefix, make_writer, make_reader, two_steps, ignoring, cli_env, monkeypatch, capsys, matrix
):
    # step-1 is to go by the listing, which names the manifest replaced right after it
    scan_then_recommit = _then_recommit(
        catalog_pruning.scan_checkpoints, make_writer, f"{s3_prefix}/step-1"
    )
    monkeypatch.setattr(catalog_pruning, "scan_checkpoints", scan_then_recommit)
    code = main(["prune", s3_prefix, "--keep-last", "1", "--endpoint-url", ignoring.endpoint_url])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.err == "s3ckpt: prune: step-1: recommitted since the listing; kept\n"
    assert "keep (recommitted since the listing)" in captured.out
    assert _loads(make_reader, f"{s3_prefix}/step-1", 10.0)  # the newest commit survived
    assert _loads(make_reader, f"{s3_prefix}/step-2", 2.0)
    _row(matrix, "s3ckpt prune, If-Match ignored, recommitted after its listing",
         {"recommit": 1, **ignoring.counts})  # fmt: skip


def test_prune_keeps_a_checkpoint_recommitted_just_before_its_delete(
    s3_prefix, make_writer, make_reader, two_steps, through, monkeypatch, ignoring, matrix
):
    # the old manifest, whose objects are to go, read just before the recommit
    read_then_recommit = _then_recommit(unpublish_module.read_manifest, make_writer)
    monkeypatch.setattr(unpublish_module, "read_manifest", read_then_recommit)
    report = catalog.prune(s3_prefix, keep_last=1, **through)
    assert report.removed == [] and report.changed == ["step-1"]
    assert report.why_changed == {"step-1": "recommitted since the listing"}
    assert _loads(make_reader, f"{s3_prefix}/step-1", 10.0)
    assert catalog.verify_checkpoint(f"{s3_prefix}/step-1", **through).ok
    _row(matrix, "prune, If-Match ignored, recommitted just before its delete",
         {"recommit": 1, **ignoring.counts})  # fmt: skip


def test_prune_keeps_a_checkpoint_a_save_started_into_after_its_listing(
    s3_prefix, make_writer, make_reader, two_steps, through, monkeypatch, ignoring, matrix
):
    real_scan = catalog_pruning.scan_checkpoints
    started: list[PausedSave] = []

    async def scan_then_start_a_save(store, location):
        listing = await real_scan(store, location)
        writer = make_writer(f"{s3_prefix}/step-1", overwrite=True)
        started.append(await asyncio.to_thread(PausedSave, writer, _state(10.0)))
        return listing

    monkeypatch.setattr(catalog_pruning, "scan_checkpoints", scan_then_start_a_save)
    report = catalog.prune(s3_prefix, keep_last=1, **through)
    assert report.removed == []
    assert report.why_changed == {"step-1": "a save started there since the listing"}
    assert _loads(make_reader, f"{s3_prefix}/step-1", 1.0)  # still the old one, whole
    started[0].release()
    assert _loads(make_reader, f"{s3_prefix}/step-1", 10.0)
    _row(matrix, "prune, If-Match ignored, a save started after its listing",
         {"save started": 1, **ignoring.counts})  # fmt: skip


def test_prune_still_deletes_on_a_store_without_conditional_deletes(
    s3_prefix, make_writer, through, list_keys
):
    for step in (1, 2, 3):
        dcp.save(_state(step), storage_writer=make_writer(f"{s3_prefix}/step-{step}"))
    report = catalog.prune(s3_prefix, keep_last=1, **through)
    assert [r.name for r in report.removed] == ["step-1", "step-2"] and report.changed == []
    assert list_keys(f"{s3_prefix}/step-1") == list_keys(f"{s3_prefix}/step-2") == []


def test_rm_refuses_a_checkpoint_recommitted_while_it_runs(
    s3_prefix, make_writer, make_reader, ignoring, cli_env, monkeypatch, capsys
):
    uri = f"{s3_prefix}/step-1"
    dcp.save(_state(1.0), storage_writer=make_writer(uri))
    real_read = unpublish_module.read_manifest

    async def read_then_recommit(store, location):
        manifest = await real_read(store, location)
        overwrite = make_writer(uri, overwrite=True)
        await asyncio.to_thread(dcp.save, _state(10.0), storage_writer=overwrite)
        return manifest

    monkeypatch.setattr(unpublish_module, "read_manifest", read_then_recommit)
    code = main(["rm", uri, "--endpoint-url", ignoring.endpoint_url])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert (
        err == f"s3ckpt rm: error: {uri} was not removed: recommitted since the listing; kept it\n"
    )
    assert _loads(make_reader, uri, 10.0)


# -- clocks -----------------------------------------------------------------------------


@pytest.fixture
def skewed(monkeypatch):
    """``skewed(seconds)``: this machine's clock (``time.time``) off by ``seconds``."""
    real = time.time

    def skew(seconds: float) -> None:
        monkeypatch.setattr(time, "time", lambda: real() + seconds)

    yield skew
    monkeypatch.setattr(time, "time", real)


def _record_age(store: ObjectStore, key: str) -> float:
    """How old the object at ``key`` is by the store's own clock."""
    meta = io_loop().run(store.head(key))
    assert meta.last_modified is not None
    now = io_loop().run(store.server_time())
    assert now is not None
    return now - meta.last_modified.timestamp()


def test_gc_measures_in_flight_records_with_the_store_clock(
    local_s3, s3_prefix, make_writer, make_reader, store, list_keys, skewed, matrix
):
    lease = 10.0  # short, so that a dead save's record expires within the test
    location = S3URI.parse(s3_prefix)
    dead_id = "00000000000000d1"
    dead = {
        f"step-1/{saving_key(dead_id)}": b'{"save_id": "00000000000000d1"}',
        f"step-1/data/r00000-{dead_id}-0000.bin": b"x" * 100,
    }
    for key, body in dead.items():
        local_s3.client().put_object(Bucket=location.bucket, Key=location.key(key), Body=body)
    running = PausedSave(make_writer(f"{s3_prefix}/step-2"), _state(2.0))
    record = next(k for k in list_keys(f"{s3_prefix}/step-2") if ".s3ckpt-saving-" in k)
    running_id = record.rsplit("-", 1)[1]
    for _ in range(600):  # until the dead save's record is past the lease, by the store's clock
        if _record_age(store, location.key(f"step-1/{saving_key(dead_id)}")) > lease:
            break
        time.sleep(0.25)

    for skew in SKEWS:
        io_loop().run(mark_in_flight(store, location.child("step-2"), running_id))  # a beat
        skewed(skew)
        report = io_loop().run(
            acollect_garbage(store, location, grace=0.0, lease=lease, dry_run=True)
        )
        skewed(0.0)
        assert report.in_flight == ["step-2"], skew  # the running save keeps its directory
        assert [(g.name, g.reason) for g in report.garbage] == [("step-1", "uncommitted")], skew

    io_loop().run(mark_in_flight(store, location.child("step-2"), running_id))
    skewed(SKEWS[0])
    io_loop().run(acollect_garbage(store, location, grace=0.0, lease=lease))
    skewed(0.0)
    assert list_keys(f"{s3_prefix}/step-1") == []
    running.release()
    assert _loads(make_reader, f"{s3_prefix}/step-2", 2.0)
    _row(matrix, "gc with the local clock 2 h ahead and 2 h behind", {"clock skew": 2})


def test_prune_keeps_a_checkpoint_being_overwritten_whatever_the_local_clock(
    s3_prefix, make_writer, make_reader, two_steps, store, list_keys, skewed, matrix
):
    location = S3URI.parse(s3_prefix)
    overwrite = PausedSave(make_writer(f"{s3_prefix}/step-1", overwrite=True), _state(10.0))
    for skew, dry_run in ((*SKEWS[:1], True), (*SKEWS[1:], True), (*SKEWS[:1], False)):
        skewed(skew)
        report = io_loop().run(
            catalog_pruning.aprune(store, location, keep_last=0, force=True, dry_run=dry_run)
        )
        skewed(0.0)
        kept = {d.name: d.reason for d in report.decisions if not d.delete}
        assert kept == {"step-1": "save in flight"}, skew
        assert [r.name for r in report.removed] == ["step-2"], skew
    assert list_keys(f"{s3_prefix}/step-2") == []
    overwrite.release()
    assert _loads(make_reader, f"{s3_prefix}/step-1", 10.0)
    _row(matrix, "prune next to a running overwrite, local clock 2 h off", {"clock skew": 3})
