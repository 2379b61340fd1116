"""The one rule for naming steps (:mod:`s3ckpt.catalog.steps`), and how retention and a
run's listing apply it, without a store."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

import s3ckpt
from s3ckpt.catalog.retention import Candidate, plan_retention
from s3ckpt.catalog.run_listing import read_steps, steps_named
from s3ckpt.catalog.scan import group_keys
from s3ckpt.catalog.steps import not_a_step, preferred, same_step
from s3ckpt.errors import ConfigError
from s3ckpt.s3.store import ObjectMeta

NOW = 1_000_000.0


def test_step_name_is_padded_and_step_of_reads_any_digits():
    assert s3ckpt.step_name(300) == "step-0000000300"
    assert s3ckpt.step_name(12_345_678_901) == "step-12345678901"
    for name in ("step-300", "step-0300", "step-0000000300"):
        assert s3ckpt.step_of(name) == 300
    assert s3ckpt.step_of("step-0") == 0


@pytest.mark.parametrize(
    "name",
    [
        "step-",
        "step-12a",
        "step-300.hf-source",
        "step--1",
        "step-+1",
        "Step-3",
        "step-٣",
        "x/step-3",
    ],
)
def test_other_names_are_not_steps(name):
    assert s3ckpt.step_of(name) is None


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None])
def test_step_name_refuses_what_is_no_step(bad):
    with pytest.raises(ConfigError):
        s3ckpt.step_name(bad)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("step-12a", "step 12 is followed by 'a'"),
        ("step-300.hf-source", "step 300 is followed by '.hf-source'"),
        ("step--1", "'step-' is followed by '-1'"),
        ("step-", "no step number"),
        ("step_300", "steps are named 'step-<digits>'"),
        ("STEP-3", "steps are named 'step-<digits>'"),
    ],
)
def test_names_that_look_like_steps_say_why_they_are_not(name, why):
    assert why in (not_a_step(name) or "")


@pytest.mark.parametrize("name", ["step-3", "latest", "best-model", "steps", "stepwise", "epoch-3"])
def test_steps_and_unrelated_names_need_no_reason(name):
    assert not_a_step(name) is None


def test_a_step_named_twice_is_known_by_the_padded_name():
    assert preferred(["step-300", "step-0000000300", "step-00300"]) == "step-0000000300"
    assert preferred(["step-0300", "step-300"]) == "step-300"  # no padded one: the shortest
    assert same_step(["step-300", "step-0000000300", "run/step-7", "run/step-07", "step-7"]) == {
        "step-300": "step-0000000300",
        "run/step-07": "run/step-7",
    }


def test_retention_counts_a_step_named_twice_once_and_never_a_name_that_is_no_step():
    candidates = [
        Candidate("step-1", NOW - 9),
        Candidate("step-2", NOW - 8),
        Candidate("step-0000000002", NOW - 7),
        Candidate("step-3", NOW - 6),
        Candidate("step-0000000003", NOW - 5),
        Candidate("step-3.hf-source", NOW - 4),
        Candidate("step-12a", NOW - 3),
        Candidate("step-4", NOW - 2),
    ]
    decisions = {d.name: d for d in plan_retention(candidates, keep_last=2, now=NOW)}
    assert sorted(n for n, d in decisions.items() if d.delete) == [
        "step-0000000002",
        "step-1",
        "step-2",
    ]
    assert decisions["step-3"].reason == "same step as step-0000000003"
    assert decisions["step-0000000003"].reason == "last 2"
    assert decisions["step-4"].reason == "newest"
    assert decisions["step-3.hf-source"].reason == decisions["step-12a"].reason == "not a step"
    # nothing but names that are no steps: still never deleted, even forced
    odd = [Candidate("step-12a", NOW - 9), Candidate("step-x", NOW - 8)]
    assert not any(d.delete for d in plan_retention(odd, keep_last=0, force=True, now=NOW))


def test_other_naming_conventions_are_pruned_as_before():
    """``step_1`` is no step name, but nothing like a misspelt one either: another tool's
    convention, which ``prune`` orders and expires as it always did."""
    candidates = [Candidate("step_1", NOW - 9), Candidate("step_2", NOW - 8)]
    assert [d.name for d in plan_retention(candidates, keep_last=1, now=NOW) if d.delete] == [
        "step_1"
    ]


def test_a_runs_steps_from_committed_names():
    found = steps_named(
        {
            "step-100": None,
            "step-0000000300": None,
            "step-300": None,
            "step-400": "step-0000000300",  # a rollback committed 300 after it
            "step-12a": None,
            "best": None,
            "other/step-5": None,
        }
    )
    assert found.names == {100: "step-100", 300: "step-0000000300", 400: "step-400"}
    assert found.current() == [100, 300] and found.latest() == 300
    why = {n.name: (n.why, n.warn) for n in found.notes}
    assert why["step-300"] == (
        "step 300 is committed as step-0000000300 and as step-300: step-0000000300 is used",
        True,
    )
    assert why["step-12a"][1] is True and "followed by 'a'" in why["step-12a"][0]
    assert why["other/step-5"][1] is False and "best" not in why


def meta(key: str, second: float) -> ObjectMeta:
    when = datetime.fromtimestamp(second, tz=timezone.utc)
    return ObjectMeta(key=key, size=1, etag='"e"', last_modified=when)


def test_a_runs_listing_notes_uncommitted_and_foreign_step_folders_and_dead_saves():
    keys = [
        meta("run/step-1/manifest.json", NOW - 50),
        meta("run/step-1/metadata-aa.pkl", NOW - 51),
        # a save of step 2 killed before its commit, then step 2 saved again and committed
        meta("run/step-2/.s3ckpt-saving-bb", NOW - 40),
        meta("run/step-2/metadata-cc.pkl", NOW - 11),
        meta("run/step-2/manifest.json", NOW - 10),
        # an overwrite of step 1 running now
        meta("run/step-1/.s3ckpt-saving-dd", NOW - 5),
        # a save of step 3 in flight (no manifest yet)
        meta("run/step-3/.s3ckpt-saving-ee", NOW - 2),
    ]
    found = read_steps(group_keys("run", keys), folders=["step-9", "step-x9"], now=NOW)
    assert found.names == {1: "step-1", 2: "step-2"}
    assert found.committed["step-1"].writing == {("run/step-1/.s3ckpt-saving-dd", NOW - 5)}
    assert found.committed["step-2"].writing == frozenset()  # the dead save's record
    why = {n.name: n.why for n in found.notes}
    assert "step-3 holds no committed checkpoint" in why["step-3"]
    assert "step-9 holds no s3ckpt checkpoint" in why["step-9"]
    assert "is not a step name" in why["step-x9"]
