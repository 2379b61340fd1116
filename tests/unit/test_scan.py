"""Grouping a listing into checkpoints, from object names alone."""

from __future__ import annotations

from datetime import datetime, timezone

from s3ckpt.catalog.scan import data_directory, group_keys
from s3ckpt.s3.store import ObjectMeta


def meta(key: str, size: int = 10, at: float = 1000.0) -> ObjectMeta:
    return ObjectMeta(key, size, '"etag"', datetime.fromtimestamp(at, tz=timezone.utc))


def test_keys_are_grouped_by_checkpoint_directory():
    scan = group_keys(
        "run",
        [
            meta("run/step-1/manifest.json", 5, at=1010),
            meta("run/step-1/metadata-aaaa.pkl", 7, at=1009),
            meta("run/step-1/data/r00000-aaaa-0000.bin", 100),
            meta("run/step-1/data/r00001-aaaa-0000.bin", 100),
            meta("run/a/b/data/r00000-bbbb-0000.bin", 50, at=2000),
            meta("run/a/b/.s3ckpt-probe-0123abcd"),
            meta("run/notes.txt"),
            meta("run/step-1/data/readme.md"),
        ],
    )
    assert set(scan.groups) == {"step-1", "a/b"}
    step1, ab = scan.groups["step-1"], scan.groups["a/b"]
    assert step1.committed and step1.bytes == 212 and step1.newest == 1010
    assert step1.committed_save_hint() == "aaaa" and step1.ranks("aaaa") == 2
    assert not ab.committed and ab.bytes == 50 and ab.newest == 2000
    assert [p.key for p in scan.probes] == ["run/a/b/.s3ckpt-probe-0123abcd"]


def test_the_prefix_itself_can_be_a_checkpoint_and_the_bucket_root_a_prefix():
    scan = group_keys("run/step-1", [meta("run/step-1/manifest.json")])
    assert set(scan.groups) == {""}
    scan = group_keys("", [meta("x/manifest.json"), meta("data/r00000-aaaa-0000.bin")])
    assert set(scan.groups) == {"x", ""}


def test_the_committed_save_is_guessed_from_the_newest_metadata_before_the_commit():
    scan = group_keys(
        "p",
        [
            meta("p/c/manifest.json", at=500),
            meta("p/c/metadata-0001.pkl", at=100),  # an older save, overwritten
            meta("p/c/metadata-0002.pkl", at=499),  # the committed one
            meta("p/c/metadata-0003.pkl", at=900),  # a later overwrite that never committed
            meta("p/c/data/r00000-0002-0000.bin"),
            meta("p/c/data/r00000-0003-0000.bin"),
            meta("p/c/data/r00001-0003-0000.bin"),
        ],
    )
    group = scan.groups["c"]
    assert group.committed_save_hint() == "0002"
    assert group.ranks("0002") == 1 and group.save_ids() == {"0001", "0002", "0003"}


def test_data_directory():
    assert data_directory("step-1/data/r00000-ab12-0000.bin") == "step-1"
    assert data_directory("data/r00003-ab12-0007.bin") == ""
    assert data_directory("step-1/data/other.bin") is None
    assert data_directory("step-1/data/a/r00000-ab12-0000.bin") == "step-1"  # spread prefixes
    assert data_directory("run/step-2/data/3f0/r00001-ab12-0001.bin") == "run/step-2"
    assert data_directory("step-1/data/xyz/r00000-ab12-0000.bin") is None
    assert data_directory("step-1/metadata-ab12.pkl") is None
