"""Which in-flight records mark a committed checkpoint busy, when ``LastModified`` has whole
seconds: an overwrite that starts (and writes its metadata object) within the second of
the previous commit must never be taken for the committed save (prune, gc and the
manager's retention would then delete the checkpoint it is writing)."""

from __future__ import annotations

from datetime import datetime, timezone

from s3ckpt.catalog.scan import group_keys
from s3ckpt.format.layout import LEASE_S
from s3ckpt.s3.store import ObjectMeta

COMMIT = 1000.0  # the second of the committed manifest
NOW = COMMIT + 30


def meta(key: str, at: float) -> ObjectMeta:
    return ObjectMeta(key, 10, '"etag"', datetime.fromtimestamp(at, tz=timezone.utc))


def group(*objects: tuple[str, float]):
    listed = [meta("run/step-1/manifest.json", COMMIT)]
    listed += [meta(f"run/step-1/{name}", at) for name, at in objects]
    return group_keys("run", listed).groups["step-1"]


def test_an_overwrite_of_the_commits_own_second_is_in_flight():
    """The committed save 0001 wrote its metadata a second before its manifest; the
    overwrite 0002 planned (its record) and wrote its metadata object in the commit's
    second, and has yet to write its manifest."""
    step = group(
        ("metadata-0001.pkl", COMMIT - 1),
        ("metadata-0002.pkl", COMMIT),
        (".s3ckpt-saving-0002", COMMIT),
        ("data/r00000-0002-0000.bin", COMMIT),
    )
    assert step.committed_save_hint() == "0002"  # ls's guess: the newest before the commit
    assert step.committed_save() is None  # not sure of it
    assert step.in_flight(NOW)


def test_an_overwrite_tied_with_the_committed_metadata_is_in_flight():
    step = group(
        ("metadata-0001.pkl", COMMIT),
        ("metadata-0002.pkl", COMMIT),
        (".s3ckpt-saving-0001", COMMIT),
        (".s3ckpt-saving-0002", COMMIT),
    )
    assert step.committed_save() is None
    assert step.in_flight(NOW)


def test_the_committed_saves_own_record_does_not_count_where_the_listing_is_sure():
    """A save that committed and died before deleting its record: not a save in flight,
    whether its metadata is the only one or older than the commit's second."""
    alone = group(("metadata-0001.pkl", COMMIT), (".s3ckpt-saving-0001", COMMIT))
    assert alone.committed_save() == "0001" and not alone.in_flight(NOW)
    overwritten = group(
        ("metadata-0000.pkl", COMMIT - 50),  # the save it replaced
        ("metadata-0001.pkl", COMMIT - 1),
        (".s3ckpt-saving-0001", COMMIT),
    )
    assert overwritten.committed_save() == "0001" and not overwritten.in_flight(NOW)


def test_records_before_the_commit_or_past_the_lease_do_not_count():
    step = group(
        ("metadata-0001.pkl", COMMIT - 1),
        (".s3ckpt-saving-0009", COMMIT - 1),  # a save killed before this commit
    )
    assert not step.in_flight(NOW)
    later = group(("metadata-0001.pkl", COMMIT - 1), (".s3ckpt-saving-0002", COMMIT + 5))
    assert later.in_flight(NOW) and not later.in_flight(COMMIT + 5 + LEASE_S)


def test_an_uncommitted_directory_is_in_flight_while_its_record_is_fresh():
    listed = [meta("run/step-2/.s3ckpt-saving-0003", COMMIT)]
    step = group_keys("run", listed).groups["step-2"]
    assert step.committed_save() is None
    assert step.in_flight(NOW) and not step.in_flight(COMMIT + LEASE_S)
