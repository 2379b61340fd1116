"""The STATUS of ``s3ckpt ls`` rows, from the fields the catalog fills in (docs/cli.md)."""

from __future__ import annotations

import dataclasses

import pytest

from s3ckpt.catalog.api import CheckpointInfo
from s3ckpt.cli.states import status

NOW = 1_000_000.0
BASE = CheckpointInfo("step-1", "s3://b/p/step-1", True, NOW - 600, 10, 3, 1)


def row(**changes: object) -> CheckpointInfo:
    return dataclasses.replace(BASE, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, "committed"),
        ({"superseded_by": "step-0"}, "committed, superseded by step-0"),
        ({"in_flight": True, "silent": 30.0}, "committed, overwrite in flight"),
        (
            {"in_flight": True, "silent": 200.0, "left": 4, "uploads": 1, "gc_after": NOW + 3420},
            "committed, overwrite silent 3m 20s (stopped?): 4 objects, 1 open upload left; "
            "gc removes them in 57m",
        ),
        (
            {"left": 1, "gc_after": NOW + 3120},
            "committed, a stopped save left 1 object; gc removes it in 52m",
        ),
        (
            {"superseded_by": "step-0", "left": 2, "gc_after": NOW - 5},
            "committed, superseded by step-0, a stopped save left 2 objects; gc removes them now",
        ),
        ({"committed": False, "in_flight": True, "silent": 0.0}, "saving"),
        (
            {"committed": False, "left": 3, "uploads": 2, "gc_after": NOW + 2400},
            "uncommitted, save stopped: 3 objects, 2 open uploads left; gc removes them in 40m",
        ),
        (
            {
                "committed": False,
                "in_flight": True,
                "silent": 180.0,
                "left": 2,
                "gc_after": NOW + 60,
            },
            "uncommitted, save silent 3m (stopped?): 2 objects left; gc removes them in 1m",
        ),
        ({"committed": False}, "uncommitted"),
        ({"damaged": "checksum mismatch in manifest"}, "damaged"),
        (
            {"committed": False, "foreign": "s3://b/p/step-1/manifest.json is not s3ckpt's"},
            "foreign",
        ),
    ],
)
def test_status(changes: dict[str, object], expected: str) -> None:
    assert status(row(**changes), NOW) == expected


def test_a_record_silent_past_two_heartbeats_is_no_longer_running() -> None:
    assert row(in_flight=True, silent=119.0).running
    assert not row(in_flight=True, silent=121.0).running
    assert not row(in_flight=False, silent=None).running
