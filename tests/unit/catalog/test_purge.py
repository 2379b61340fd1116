"""The rules for versioned buckets, from listings alone: which versions ``rm``, ``prune``
and ``gc`` delete by id as s3ckpt's (:mod:`s3ckpt.catalog.purge`), and when a commit
probes conditional writes again (:func:`s3ckpt.transfer.commit.supports_conditional_create`).
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

import pytest

from s3ckpt.catalog.purge import own_versions
from s3ckpt.config import S3URI
from s3ckpt.errors import StorageError
from s3ckpt.s3.versions import ObjectVersion
from s3ckpt.transfer import commit

DATA = "run/step-1/data/r00000-aaaa-0000.bin"
MANIFEST = "run/step-1/manifest.json"


def version(key: str, vid: str, at: float, *, size: int = 10, etag: str = '"e1"',
            latest: bool = False, marker: bool = False) -> ObjectVersion:  # fmt: skip
    when = datetime.fromtimestamp(at, tz=timezone.utc)
    return ObjectVersion(
        key, vid, latest, marker, 0 if marker else size, "" if marker else etag, when
    )


def chosen(entries: list[ObjectVersion], etags: dict[str, str] | None = None) -> list[str]:
    picked, _ = own_versions(entries, lambda key, latest: True, etags or {})
    return sorted(v.version_id for v in picked)


def test_a_deleted_key_whose_versions_hold_one_save_s_bytes_goes_whole():
    entries = [
        version(DATA, "d", 3, latest=True, marker=True),
        version(DATA, "v2", 2),  # a retry: the same bytes
        version(DATA, "v1", 1),
    ]
    assert chosen(entries) == ["d", "v1", "v2"]


def test_another_writer_s_bytes_leave_the_key_alone_and_are_reported():
    entries = [
        version(DATA, "d", 3, latest=True, marker=True),
        version(DATA, "v2", 2, etag='"theirs"'),
        version(DATA, "v1", 1),
    ]
    picked, kept = own_versions(entries, lambda key, latest: True, {})
    assert picked == [] and len(kept) == 1 and DATA in kept[0]


def test_a_key_with_a_current_version_or_a_delete_not_to_follow_is_untouched():
    live = [version(DATA, "v2", 2, latest=True), version(DATA, "v1", 1)]
    assert chosen(live) == []
    deleted = [version(DATA, "d", 3, latest=True, marker=True), version(DATA, "v1", 1)]
    picked, _ = own_versions(deleted, lambda key, latest: latest.last_modified is None, {})
    assert picked == []  # e.g. gc: a delete younger than its grace


def test_only_the_manifest_deleted_goes_and_its_markers_stay_over_older_commits():
    entries = [
        version(MANIFEST, "d", 3, latest=True, marker=True),
        version(MANIFEST, "m2", 2, etag='"second"'),
        version(MANIFEST, "m1", 1, etag='"first"'),
    ]
    assert chosen(entries, {MANIFEST: '"second"'}) == ["m2"]
    assert chosen(entries, {}) == []  # no manifest read: none is known to be s3ckpt's
    alone = entries[:2]
    assert chosen(alone, {MANIFEST: "second"}) == ["d", "m2"]  # nothing left under the marker


def test_a_probe_s_versions_are_its_own_whatever_their_bytes():
    probe = "run/step-1/.s3ckpt-probe-0123abcd"
    entries = [
        version(probe, "d", 3, latest=True, marker=True),
        version(probe, "p2", 2, etag='"two"'),
        version(probe, "p1", 1, etag='"one"'),
    ]
    assert chosen(entries) == ["d", "p1", "p2"]


# -- the commit's re-check --------------------------------------------------------------


@pytest.fixture
def probed(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[bool]]:
    """The versioning states the commit will read (a StorageError: refused), and the
    probes it runs (whether each ran on a versioned bucket). Each probe finds the
    conditional create honoured only on a bucket without versioning, as Ceph RGW does."""
    states: list[str] = []
    probes: list[bool] = []

    async def versioning(store: Any) -> str:
        state = states.pop(0)
        if state == "denied":
            raise StorageError("denied", code="AccessDenied")
        return state

    async def probe(store: Any, location: S3URI, *, versioned: bool = False) -> bool:
        probes.append(versioned)
        return not versioned

    monkeypatch.setattr(commit, "versioning", versioning)
    monkeypatch.setattr(commit, "_probe", probe)
    monkeypatch.setattr(commit, "_conditional_support", {})
    return states, probes


def _asks(n: int) -> list[bool]:
    config = SimpleNamespace(conditional_commit=None, endpoint_url="http://store")
    store: Any = SimpleNamespace(config=config, bucket="bucket")
    location = S3URI.parse("s3://bucket/run/step-1")

    async def ask() -> list[bool]:
        return [await commit.supports_conditional_create(store, location) for _ in range(n)]

    return asyncio.run(ask())


def test_the_probe_runs_again_only_when_the_versioning_state_changed(probed):
    states, probes = probed
    states += ["never", "never", "Enabled", "Enabled", "Suspended", "Suspended"]
    assert _asks(6) == [True, True, False, False, False, False]
    assert probes == [False, True, True]  # first commit, then each change


def test_a_store_that_refuses_get_bucket_versioning_is_probed_at_every_commit(probed):
    states, probes = probed
    states += ["denied", "denied", "denied"]
    assert _asks(3) == [True, True, True]
    assert probes == [False, False, False]
