"""Buckets with versioning on: doctor says what it means, ``rm``, ``prune`` and ``gc``
free the space of s3ckpt's own versions (never another writer's), ``ls`` and ``verify``
see current versions only, and commits stay safe when versioning is switched on under a
running job.

Each test makes a bucket of its own (versioning is a bucket's setting, and once enabled
it can only be suspended): the shared bucket of the other tests stays unversioned.
"""

from __future__ import annotations

import json
import multiprocessing
import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _commit_race_worker import ELEMENTS, state_of
from _versioning_race_worker import race_after_switch
from faultproxy import FaultProxy
from racing_writers import one_winner, outcomes, running
from s3_servers import ON_BOTH

from s3ckpt import S3StorageReader, S3StorageWriter, catalog
from s3ckpt.catalog.gc import acollect_garbage
from s3ckpt.cli.main import main
from s3ckpt.config import S3URI, make_config
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore

pytestmark = [ON_BOTH]


@pytest.fixture
def bucket(local_s3: Any) -> Iterator[str]:
    """A fresh bucket on the test's server, emptied of every version and deleted after."""
    name = f"versioned-{secrets.token_hex(6)}"
    client = local_s3.client()
    client.create_bucket(Bucket=name)
    yield name
    entries = _versions(client, name, "")
    for i in range(0, len(entries), 1000):
        batch = [{"Key": k, "VersionId": v} for k, v, *_ in entries[i : i + 1000]]
        client.delete_objects(Bucket=name, Delete={"Objects": batch, "Quiet": True})
    client.delete_bucket(Bucket=name)


def _enable(client: Any, bucket: str, status: str = "Enabled") -> None:
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": status})


def _versions(client: Any, bucket: str, prefix: str) -> list[tuple[str, str, bool, int]]:
    """(key, version id, is a delete marker, size) of every entry under ``prefix``."""
    found = []
    for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=prefix):
        found += [(v["Key"], v["VersionId"], False, v["Size"]) for v in page.get("Versions", [])]
        found += [(m["Key"], m["VersionId"], True, 0) for m in page.get("DeleteMarkers", [])]
    return found


def _options(local_s3: Any, **extra: Any) -> dict[str, Any]:
    return {
        "endpoint_url": local_s3.endpoint_url,
        "access_key_id": local_s3.access_key,
        "secret_access_key": local_s3.secret_key,
        "region": local_s3.region,
        **extra,
    }


def _save(uri: str, value: float, options: dict[str, Any], **writer: Any) -> None:
    state = {"w": torch.full((ELEMENTS,), value)}
    dcp.save(state, storage_writer=S3StorageWriter(uri, **options, **writer))


def _load(uri: str, options: dict[str, Any]) -> torch.Tensor:
    state = {"w": torch.zeros(ELEMENTS)}
    dcp.load(state, storage_reader=S3StorageReader(uri, **options))
    return state["w"]


# -- doctor -------------------------------------------------------------------------------


def _doctor(uri: str, local_s3: Any, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    main(["doctor", uri, "--endpoint-url", local_s3.endpoint_url, "--sample-mib", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    return {c["check"]: c for c in report["checks"]} | {"plan": report["plan"]}


def test_doctor_says_what_versioning_means_for_space_and_leaves_no_version(
    local_s3: Any, bucket: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    for name, value in local_s3.env().items():
        monkeypatch.setenv(name, value)
    client, uri = local_s3.client(), f"s3://{bucket}/run"
    off = _doctor(uri, local_s3, capsys)["bucket versioning"]
    assert off["status"] == "ok" and off["detail"].startswith("off")

    _enable(client, bucket)
    report = _doctor(uri, local_s3, capsys)
    check = report["bucket versioning"]
    assert check["status"] == "ok", check
    assert check["detail"].startswith("Enabled: a delete only adds a delete marker")
    assert "noncurrent version" in check["detail"]
    assert "NoncurrentVersionExpiration" in check["detail"]  # the rule to set
    assert any("by version id" in step for step in report["plan"])
    assert _versions(client, bucket, "run/") == []  # the doctor's scratch, every version

    rule = {"ID": "old", "Status": "Enabled", "Filter": {"Prefix": ""}}
    rule["NoncurrentVersionExpiration"] = {"NoncurrentDays": 3}
    client.put_bucket_lifecycle_configuration(
        Bucket=bucket, LifecycleConfiguration={"Rules": [rule]}
    )
    _enable(client, bucket, "Suspended")
    check = _doctor(uri, local_s3, capsys)["bucket versioning"]
    assert check["detail"].startswith("Suspended: a delete only adds a delete marker")
    assert "expires noncurrent versions after 3 day(s)" in check["detail"]
    # No version with bytes is left. (SeaweedFS keeps a "null" delete marker that is
    # deleted by its id on a suspended bucket: it answers success, and holds no bytes.)
    assert [v for v in _versions(client, bucket, "run/") if not v[2]] == []


# -- rm, prune and gc ---------------------------------------------------------------------


def test_rm_prune_and_gc_delete_s3ckpts_versions_and_keep_other_writers(
    local_s3: Any, bucket: str
) -> None:
    """Three checkpoints, a save that stopped (objects of s3ckpt's names, no manifest),
    and another writer's objects, some with several versions and one deleted: ``rm``,
    ``prune`` and ``gc`` leave no version of s3ckpt's behind except the kept checkpoint's
    current ones, and every version of the other writer's."""
    client, options = local_s3.client(), _options(local_s3)
    config = {"config": make_config(None, **options)}
    _enable(client, bucket)
    run = f"s3://{bucket}/run"
    for step in (1, 2, 3):
        _save(f"{run}/step-{step}", float(step), options)
    # Another writer: notes beside step 1 (two versions), and a file of its own, deleted.
    for body in (b"first", b"second"):
        client.put_object(Bucket=bucket, Key="run/step-1/notes.txt", Body=body)
        client.put_object(Bucket=bucket, Key="run/theirs/model.bin", Body=body * 100)
    client.delete_object(Bucket=bucket, Key="run/theirs/model.bin")
    # A save that stopped: its metadata and a data object written twice (a retry), and a
    # data object of its name that another writer wrote over, then deleted.
    stopped = secrets.token_hex(16)
    client.put_object(Bucket=bucket, Key=f"run/step-4/metadata-{stopped}.pkl", Body=b"m" * 50)
    for _ in range(2):
        client.put_object(
            Bucket=bucket, Key=f"run/step-4/data/r00000-{stopped}-0000.bin", Body=b"d" * 4096
        )
    mixed = f"run/step-4/data/r00001-{stopped}-0000.bin"
    client.put_object(Bucket=bucket, Key=mixed, Body=b"x" * 4096)
    client.put_object(Bucket=bucket, Key=mixed, Body=b"other writer")
    client.delete_object(Bucket=bucket, Key=mixed)
    theirs_before = [
        v for v in _versions(client, bucket, "run/") if "theirs" in v[0] or "notes" in v[0]
    ]

    removed = catalog.remove_checkpoint(f"{run}/step-1", **config)
    assert removed.versions > 0 and removed.version_bytes >= removed.bytes - 2048
    left = _versions(client, bucket, "run/step-1/")
    assert sorted(k for k, *_ in left) == ["run/step-1/notes.txt"] * 2  # theirs only

    report = catalog.prune(run, keep_last=1, **config)
    assert [r.name for r in report.removed] == ["step-2"] and report.removed[0].versions > 0
    assert _versions(client, bucket, "run/step-2/") == []

    store = ObjectStore(make_config(None, **options), bucket)
    location = S3URI.parse(run)
    before = _versions(client, bucket, "run/")
    dry = io_loop().run(
        acollect_garbage(store, location, grace=0, dry_run=True, now=time.time() + 60)
    )
    assert dry.versions > 0 and _versions(client, bucket, "run/") == before  # counted only
    gc = io_loop().run(acollect_garbage(store, location, grace=0, now=time.time() + 60))
    assert {g.name for g in gc.garbage if g.reason == "uncommitted"} == {"step-4"}
    assert gc.versions >= 3  # the stopped save's versions, its retry's, and their markers
    assert any(mixed in p for p in gc.problems)  # another writer's bytes at s3ckpt's name
    step4 = _versions(client, bucket, "run/step-4/")
    assert {k for k, *_ in step4} == {mixed}  # left alone whole: 2 versions, 1 marker
    assert sorted(m for k, _, m, _ in step4) == [False, False, True]
    theirs = [v for v in _versions(client, bucket, "run/") if "theirs" in v[0] or "notes" in v[0]]
    assert sorted(theirs) == sorted(theirs_before)

    # What is left of s3ckpt's: step 3, current versions only; ls and verify see it whole.
    ours = [v for v in _versions(client, bucket, "run/") if v not in theirs and v[0] != mixed]
    assert all(k.startswith("run/step-3/") and not marker for k, _, marker, _ in ours)
    current = client.list_objects_v2(Bucket=bucket, Prefix="run/step-3/")["Contents"]
    assert len(ours) == len(current)
    assert [c.name for c in catalog.list_checkpoints(run, **config)] == ["step-3"]
    assert catalog.verify_checkpoint(f"{run}/step-3", **config).ok
    assert torch.equal(_load(f"{run}/step-3", options), state_of(3)["w"])


def test_gc_keeps_the_versions_of_a_checkpoint_another_tool_deleted(
    local_s3: Any, bucket: str
) -> None:
    """A committed checkpoint deleted by another tool (every key, as ``aws s3 rm
    --recursive`` does): gc deletes no version of its manifest or data, so removing the
    delete markers brings it back whole."""
    client, options = local_s3.client(), _options(local_s3)
    _enable(client, bucket)
    uri = f"s3://{bucket}/run/step-7"
    _save(uri, 7.0, options)
    keys = [c["Key"] for c in client.list_objects_v2(Bucket=bucket, Prefix="run/")["Contents"]]
    client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys]})
    kept = [v for v in _versions(client, bucket, "run/") if v[0] in keys and not v[2]]

    store = ObjectStore(make_config(None, **options), bucket)
    gc = io_loop().run(
        acollect_garbage(store, S3URI.parse(f"s3://{bucket}/run"), grace=0, now=time.time() + 60)
    )
    assert gc.garbage == [] and gc.problems == []
    after = _versions(client, bucket, "run/")
    assert all(v in after for v in kept)  # nothing of the checkpoint's versions went

    markers = [{"Key": k, "VersionId": vid} for k, vid, marker, _ in after if marker]
    client.delete_objects(Bucket=bucket, Delete={"Objects": markers})
    assert torch.equal(_load(uri, options), state_of(7)["w"])
    assert catalog.verify_checkpoint(uri, config=make_config(None, **options)).ok


def test_ls_verify_and_load_see_the_current_versions_of_an_overwritten_checkpoint(
    local_s3: Any, bucket: str
) -> None:
    """An overwrite on a versioned bucket: the old manifest stays as a noncurrent
    version, and ls, verify and a load see only the new save; gc then deletes the old
    save's objects and their versions, and leaves the old manifest's version (a
    lifecycle rule's)."""
    client, options = local_s3.client(), _options(local_s3)
    config = {"config": make_config(None, **options)}
    _enable(client, bucket)
    uri = f"s3://{bucket}/latest"
    _save(uri, 1.0, options)
    _save(uri, 2.0, options, overwrite=True)
    manifests = [v for v in _versions(client, bucket, "latest/") if v[0].endswith("manifest.json")]
    assert len(manifests) == 2
    infos = catalog.list_checkpoints(uri, details=True, **config)
    shown = catalog.show_checkpoint(uri, **config)
    assert [(i.name, i.save_id) for i in infos] == [("", shown.save_id)]
    assert catalog.verify_checkpoint(uri, **config).ok
    assert torch.equal(_load(uri, options), state_of(2)["w"])

    store = ObjectStore(make_config(None, **options), bucket)
    gc = io_loop().run(acollect_garbage(store, S3URI.parse(uri), grace=0, now=time.time() + 60))
    assert [g.reason for g in gc.garbage] == ["unreferenced"] and gc.versions > 0
    left = _versions(client, bucket, "latest/")
    current = {
        c["Key"] for c in client.list_objects_v2(Bucket=bucket, Prefix="latest/")["Contents"]
    }
    assert {k for k, _, marker, _ in left if not marker} == current
    counts = {k: sum(1 for v in left if v[0] == k) for k in current}
    assert {k.rpartition("/")[2]: n for k, n in counts.items() if n > 1} == {"manifest.json": 2}
    assert torch.equal(_load(uri, options), state_of(2)["w"])


# -- versioning switched on under a running job -------------------------------------------


class IgnoresConditionalWhenVersioned(FaultProxy):
    """A proxy that behaves as Ceph RGW does (moto and SeaweedFS honour ``If-None-Match:
    *`` on versioned buckets too): it strips ``If-None-Match``/``If-Match`` from requests
    while the bucket's versioning is ``Enabled``, asking the server before each request
    (RGW's switch is immediate), and relays everything untouched otherwise."""

    def __init__(self, server: Any, bucket: str) -> None:
        self._client, self._bucket = server.client(), bucket
        super().__init__(server.endpoint_url, secret_key=server.secret_key)

    @property  # type: ignore[override]
    def conditional(self) -> str:
        status = self._client.get_bucket_versioning(Bucket=self._bucket).get("Status")
        return "ignore" if status == "Enabled" else "pass"

    @conditional.setter
    def conditional(self, value: str) -> None:
        pass  # what the bucket's versioning says, always


@pytest.mark.timeout(300)
def test_versioning_switched_on_between_saves_keeps_one_winner_among_racing_writers(
    local_s3: Any, bucket: str
) -> None:
    """Writer processes each commit once on an unversioned bucket (their probe: the
    conditional create is honoured), then versioning is switched on, and with it the
    store starts to ignore ``If-None-Match`` (Ceph RGW's behaviour, emulated by a proxy:
    :class:`IgnoresConditionalWhenVersioned`). Racing for the same checkpoint ids, exactly
    one writer commits each, the others get CommitConflictError, and the checkpoint holds
    the winner's bytes: each commit read the bucket's versioning, saw it changed since its
    probe, probed again, and used the claim protocol. (About 15-20 s a server: the writers
    are processes started with ``spawn``, each importing torch; the probe is per process.)"""
    writers, rounds = 2, 3
    spawn = multiprocessing.get_context("spawn")
    with IgnoresConditionalWhenVersioned(local_s3, bucket) as proxy:
        options = _options(local_s3, endpoint_url=proxy.endpoint_url)
        prefix = f"s3://{bucket}/race"
        barrier, results = spawn.Barrier(writers + 1), spawn.Queue()
        workers = [
            spawn.Process(
                target=race_after_switch, args=(n, rounds, prefix, options, barrier, results)
            )
            for n in range(writers)
        ]
        with running(workers):
            barrier.wait(timeout=240)  # every writer probed, unversioned
            assert proxy.counts["conditional_ignored"] == 0
            _enable(local_s3.client(), bucket)
            barrier.wait(timeout=60)
            for _ in range(rounds):
                barrier.wait(timeout=120)
            ended_rounds = outcomes(results, writers * rounds, timeout_s=120)
        assert proxy.counts["conditional_ignored"] > 0  # the emulation was in force
    for number in range(rounds):
        winner = one_winner(number, ended_rounds[number])
        loaded = _load(f"{prefix}/round-{number}", _options(local_s3))
        assert torch.equal(loaded, state_of(winner)["w"]), number
