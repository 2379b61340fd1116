"""The manifest is the commit: exists completely or not at all, one winner per id."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from stored import stored_manifest

from s3ckpt import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitConflictError,
    ConfigError,
    StorageError,
    catalog,
    unwrap,
)
from s3ckpt.config import S3URI, make_config
from s3ckpt.dcp.save_commit import SaveCommit
from s3ckpt.format.manifest import MANIFEST_NAME, Manifest
from s3ckpt.s3.store import ObjectStore


def _manifest(local_s3, uri) -> Manifest:
    return stored_manifest(local_s3.client(), uri)


def test_manifest_lists_every_object_and_item(local_s3, s3_prefix, make_writer, list_keys):
    state = {
        "a": torch.arange(100.0),
        "b": torch.ones(3, 3, dtype=torch.bfloat16),
        "meta": {"step": 5},
    }
    dcp.save(state, storage_writer=make_writer(s3_prefix))
    manifest = _manifest(local_s3, s3_prefix)
    keys = list_keys(s3_prefix)
    assert sorted([*manifest.all_keys(), MANIFEST_NAME]) == keys
    items = {item.fqn: item for item in manifest.items}
    assert (
        items["a"].dtype == "float32"
        and items["a"].shape == (100,)
        and items["a"].stored.length == 400
    )
    assert items["b"].dtype == "bfloat16"
    assert (
        items["meta.step"].kind == "bytes"
        if "meta.step" in items
        else items["meta"].kind == "bytes"
    )
    assert all(o.etag for o in manifest.objects)
    head = local_s3.client().head_object(
        Bucket=local_s3.bucket, Key=S3URI.parse(s3_prefix).key(manifest.objects[0].key)
    )
    assert head["ContentLength"] == manifest.objects[0].size


def test_a_save_that_never_commits_is_invisible(s3_prefix, make_writer, make_reader, list_keys):
    writer = make_writer(s3_prefix)

    def finish_fails(metadata, results):
        raise RuntimeError("coordinator died before the commit")

    writer.finish = finish_fails  # type: ignore[method-assign]
    with pytest.raises(BaseException, match="coordinator died"):
        dcp.save({"a": torch.ones(10)}, storage_writer=writer)
    assert any(k.startswith("data/") for k in list_keys(s3_prefix))
    assert MANIFEST_NAME not in list_keys(s3_prefix)
    with pytest.raises(CheckpointNotFoundError):
        make_reader(s3_prefix).read_metadata()


def test_saving_over_a_committed_checkpoint_is_refused(
    s3_prefix, make_writer, make_reader, list_keys
):
    dcp.save({"a": torch.ones(4)}, storage_writer=make_writer(s3_prefix))
    before = list_keys(s3_prefix)
    with pytest.raises(BaseException) as info:
        dcp.save({"a": torch.zeros(4)}, storage_writer=make_writer(s3_prefix))
    assert isinstance(unwrap(info.value), CheckpointExistsError)
    assert "already committed" in str(unwrap(info.value))
    assert list_keys(s3_prefix) == before  # nothing was uploaded
    restored = {"a": torch.zeros(4)}
    dcp.load(restored, storage_reader=make_reader(s3_prefix))
    assert torch.equal(restored["a"], torch.ones(4))


def test_check_happens_before_any_upload(s3_prefix, make_writer):
    dcp.save({"a": torch.ones(4)}, storage_writer=make_writer(s3_prefix))
    writer = make_writer(s3_prefix)
    writer.set_up_storage_writer(True, rank=0)
    with pytest.raises(CheckpointExistsError):
        writer.prepare_local_plan(None)  # type: ignore[arg-type]


def test_overwrite_replaces_atomically_and_leaves_the_old_objects_to_gc(
    local_s3, s3_prefix, make_writer, make_reader, list_keys, s3_options
):
    dcp.save({"a": torch.ones(1000)}, storage_writer=make_writer(s3_prefix))
    old = _manifest(local_s3, s3_prefix)
    dcp.save({"a": torch.full((1000,), 2.0)}, storage_writer=make_writer(s3_prefix, overwrite=True))
    new = _manifest(local_s3, s3_prefix)
    assert new.save_id != old.save_id
    # The replaced save's objects stay for loads that started before the switch ...
    assert list_keys(s3_prefix) == sorted([*old.all_keys(), *new.all_keys(), MANIFEST_NAME])
    config = make_config(None, **s3_options)
    kept = catalog.collect_garbage(s3_prefix, config=config)
    assert kept.garbage == []  # ... for gc's grace period, counted from the overwrite
    catalog.collect_garbage(s3_prefix, grace=0, config=config)
    assert list_keys(s3_prefix) == sorted([*new.all_keys(), MANIFEST_NAME])
    restored = {"a": torch.zeros(1000)}
    dcp.load(restored, storage_reader=make_reader(s3_prefix))
    assert torch.equal(restored["a"], torch.full((1000,), 2.0))


def test_overwrite_keeps_a_loadable_checkpoint_at_every_moment(s3_prefix, make_writer, make_reader):
    """A reader polling throughout an overwrite always loads the old or the new state, never fails."""
    dcp.save({"a": torch.full((50_000,), 1.0)}, storage_writer=make_writer(s3_prefix))
    stop = threading.Event()
    seen: set[float] = set()
    errors: list[BaseException] = []

    def poll() -> None:
        while not stop.is_set():
            try:
                restored = {"a": torch.zeros(50_000)}
                dcp.load(restored, storage_reader=make_reader(s3_prefix))
                values = set(restored["a"].unique().tolist())
                assert len(values) == 1, values
                seen.update(values)
            except FileNotFoundError:
                # an object of the old save was deleted after the switch, mid-load: retry
                continue
            except BaseException as exc:
                if "NoSuchKey" in str(exc) or "not found" in str(exc).lower():
                    continue
                errors.append(exc)
                return

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        for value in (2.0, 3.0, 4.0):
            dcp.save(
                {"a": torch.full((50_000,), value)},
                storage_writer=make_writer(s3_prefix, overwrite=True),
            )
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not errors, errors
    assert seen <= {1.0, 2.0, 3.0, 4.0}


@pytest.mark.parametrize("conditional", [True, False], ids=["if-none-match", "fallback"])
def test_two_writers_racing_for_one_id_exactly_one_commits(
    s3_prefix, make_writer, make_reader, conditional
):
    """Both pass the existence check, both upload; the manifest write decides."""
    writers = [make_writer(s3_prefix, conditional_commit=conditional) for _ in range(2)]
    for w in writers:  # both check before either commits
        w.set_up_storage_writer(True, rank=0)
        w.prepare_local_plan(None)  # type: ignore[arg-type]
    barrier = threading.Barrier(2)
    outcomes: dict[int, BaseException | None] = {}

    def run(i: int, value: float) -> None:
        writer = writers[i]
        original = writer.finish

        def finish(metadata, results):
            barrier.wait(timeout=30)
            original(metadata, results)

        writer.finish = finish  # type: ignore[method-assign]
        writer.prepare_local_plan = lambda plan: plan  # type: ignore[method-assign]
        try:
            dcp.save({"a": torch.full((10,), value)}, storage_writer=writer)
            outcomes[i] = None
        except BaseException as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i, float(i + 1))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    failures = [exc for exc in outcomes.values() if exc is not None]
    assert len(outcomes) == 2 and len(failures) == 1, outcomes
    assert isinstance(unwrap(failures[0]), CommitConflictError), failures[0]
    winner = next(i for i, exc in outcomes.items() if exc is None)
    restored = {"a": torch.zeros(10)}
    dcp.load(restored, storage_reader=make_reader(s3_prefix))
    assert torch.equal(restored["a"], torch.full((10,), float(winner + 1)))


def test_after_commit_objects_are_written_once_the_manifest_is(
    local_s3, s3_prefix, make_writer, make_reader, monkeypatch
):
    location = S3URI.parse(s3_prefix)
    pointer = f"s3://{location.bucket}/{location.prefix}-latest"
    seen_at_pointer: list[bool] = []
    put_pointer = SaveCommit._put_after_commit

    async def observed(commit, after_commit):
        seen_at_pointer.append(_committed(local_s3, s3_prefix))
        await put_pointer(commit, after_commit)

    monkeypatch.setattr(SaveCommit, "_put_after_commit", observed)
    dcp.save(
        {"w": torch.arange(8.0)},
        storage_writer=make_writer(s3_prefix, after_commit={pointer: b"7"}),
    )
    body = local_s3.client().get_object(Bucket=location.bucket, Key=f"{location.prefix}-latest")
    assert body["Body"].read() == b"7"
    assert seen_at_pointer == [True]


def test_after_commit_objects_outside_the_bucket_are_refused_before_any_upload(
    s3_prefix, make_writer, list_keys
):
    writer = make_writer(s3_prefix, after_commit={"s3://another-bucket/latest": b"7"})
    with pytest.raises(BaseException) as info:
        dcp.save({"w": torch.arange(8.0)}, storage_writer=writer)
    assert isinstance(unwrap(info.value), ConfigError)
    assert "in the checkpoint's bucket" in str(unwrap(info.value))
    assert list_keys(s3_prefix) == []


def test_after_commit_bodies_must_be_bytes(s3_prefix, make_writer):
    with pytest.raises(ConfigError, match="must be bytes"):
        make_writer(s3_prefix, after_commit={f"{s3_prefix}-latest": "7"})


def test_a_failed_after_commit_object_fails_the_save_but_keeps_the_checkpoint(
    local_s3, s3_prefix, make_writer, make_reader, monkeypatch
):
    location = S3URI.parse(s3_prefix)
    pointer_key = f"{location.prefix}-latest"
    put = ObjectStore.put

    async def refusing(store, key, body, **kwargs):
        if key == pointer_key:
            raise StorageError("the store refused the pointer")
        return await put(store, key, body, **kwargs)

    monkeypatch.setattr(ObjectStore, "put", refusing)
    writer = make_writer(s3_prefix, after_commit={f"s3://{location.bucket}/{pointer_key}": b"7"})
    with pytest.raises(BaseException) as info:
        dcp.save({"w": torch.arange(8.0)}, storage_writer=writer)
    assert isinstance(unwrap(info.value), CheckpointError)
    assert "is committed, but" in str(unwrap(info.value))
    loaded = {"w": torch.zeros(8)}
    dcp.load(loaded, storage_reader=make_reader(s3_prefix))
    assert torch.equal(loaded["w"], torch.arange(8.0))


def _committed(local_s3, uri: str) -> bool:
    location = S3URI.parse(uri)
    found = local_s3.client().list_objects_v2(
        Bucket=location.bucket, Prefix=location.key(MANIFEST_NAME)
    )
    return found.get("KeyCount", 0) > 0


@pytest.mark.parametrize("written_s_ago", [0.0, 3600.0])
def test_the_commit_refreshes_the_in_flight_record_only_once_a_heartbeat_old(
    s3_prefix, make_writer, list_keys, monkeypatch, written_s_ago
):
    """The coordinator writes the save's in-flight record at planning; the commit writes it
    again only where that was a heartbeat or more ago (a record younger than that holds
    gc off for minutes more than the commit takes). Either way the record is gone after
    the commit."""
    import s3ckpt.dcp.save_commit as save_commit_module
    import s3ckpt.dcp.writer as writer_module

    written = []
    original = writer_module.mark_in_flight

    async def counting(store, location, save_id):
        written.append(save_id)
        return await original(store, location, save_id)

    monkeypatch.setattr(writer_module, "mark_in_flight", counting)  # at planning
    monkeypatch.setattr(save_commit_module, "mark_in_flight", counting)  # at the commit
    writer = make_writer(s3_prefix)
    real_prepare = writer.prepare_global_plan

    def planned_long_ago(plans):
        result = real_prepare(plans)
        save_id, at = writer._marked
        writer._marked = (save_id, at - written_s_ago)
        return result

    writer.prepare_global_plan = planned_long_ago
    dcp.save({"a": torch.arange(10.0)}, storage_writer=writer)
    assert written == [writer.save_id] * (1 if written_s_ago == 0 else 2)
    assert not [key for key in list_keys(s3_prefix) if ".s3ckpt-saving" in key]
