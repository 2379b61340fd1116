"""The retention policy: which checkpoints prune deletes (pure, checked exhaustively)."""

from __future__ import annotations

import itertools
import random

import pytest

from s3ckpt.catalog.retention import (
    Candidate,
    natural_key,
    order,
    plan_retention,
    series_of,
    step_of,
    superseded,
)
from s3ckpt.errors import ConfigError
from s3ckpt.manager.policy import validate_options

NOW = 1_000_000.0
DAY = 86400.0


def steps(*numbers: int, age_step: float = DAY) -> list[Candidate]:
    """step-N checkpoints, the first one oldest: each one ``age_step`` younger than the last."""
    count = len(numbers)
    return [Candidate(f"step-{n}", NOW - (count - i) * age_step) for i, n in enumerate(numbers)]


def deleted(decisions) -> list[str]:
    return [d.name for d in decisions if d.delete]


def test_natural_order_compares_numbers_as_numbers():
    names = ["step-10", "step-9", "step-100", "step-1", "a", "step-10b", "run2/step-3"]
    ordered = [c.name for c in order(Candidate(n, 0.0) for n in names)]
    assert ordered == ["a", "run2/step-3", "step-1", "step-9", "step-10", "step-10b", "step-100"]
    assert natural_key("step-009") == natural_key("step-9")


def test_equal_names_by_number_are_ordered_by_commit_time():
    ordered = order([Candidate("step-010", 5.0), Candidate("step-10", 3.0)])
    assert [c.name for c in ordered] == ["step-10", "step-010"]


def test_step_is_the_last_number_in_the_name():
    assert step_of("run2/step-300") == 300
    assert step_of("epoch3-step0042") == 42
    assert step_of("latest") is None


def test_keep_last_deletes_all_older_ones():
    decisions = plan_retention(list(reversed(steps(1, 2, 3, 10))), keep_last=2, now=NOW)
    assert [d.name for d in decisions] == ["step-1", "step-2", "step-3", "step-10"]
    assert deleted(decisions) == ["step-1", "step-2"]
    assert [d.reason for d in decisions] == ["expired", "expired", "last 2", "newest"]


def test_keep_every_protects_multiples_of_k():
    decisions = plan_retention(steps(100, 200, 300, 400, 500), keep_last=1, keep_every=200, now=NOW)
    assert deleted(decisions) == ["step-100", "step-300"]
    assert {d.name: d.reason for d in decisions}["step-200"] == "every 200"


def test_keep_every_does_not_protect_names_without_a_number():
    candidates = [Candidate("best", NOW - 3 * DAY), *steps(5, 10)]
    assert deleted(plan_retention(candidates, keep_last=1, keep_every=5, now=NOW)) == ["best"]


def test_older_than_spares_recent_checkpoints():
    candidates = steps(1, 2, 3, 4, 5)  # ages 5d .. 1d
    decisions = plan_retention(candidates, keep_last=1, older_than=2.5 * DAY, now=NOW)
    assert deleted(decisions) == ["step-1", "step-2", "step-3"]
    assert {d.name: d.reason for d in decisions}["step-4"] == "too recent"


def test_the_newest_is_kept_unless_forced():
    assert deleted(plan_retention(steps(1, 2), keep_last=0, now=NOW)) == ["step-1"]
    assert deleted(plan_retention(steps(1, 2), keep_last=0, force=True, now=NOW)) == [
        "step-1",
        "step-2",
    ]
    # force alone never overrides the other rules
    assert deleted(plan_retention(steps(1, 2), keep_last=1, force=True, now=NOW)) == ["step-1"]


def test_a_rollback_supersedes_the_abandoned_higher_steps():
    """After rolling back to step-5 and saving step-6, step-9 of the old run is abandoned:
    it is not the newest, does not count towards keep_last, and retention removes it."""
    candidates = [
        Candidate("step-5", NOW - 4 * DAY),
        Candidate("step-9", NOW - 3 * DAY),
        Candidate("step-6", NOW - 60),
    ]
    assert superseded(candidates) == {"step-9": "step-6"}
    decisions = {d.name: d for d in plan_retention(candidates, keep_last=2, now=NOW)}
    assert decisions["step-9"].delete and decisions["step-9"].reason == "superseded by step-6"
    assert [n for n, d in decisions.items() if not d.delete] == ["step-5", "step-6"]
    assert decisions["step-6"].reason == "newest"


def test_superseded_ones_are_still_protected_by_keep_every_and_older_than():
    candidates = [Candidate("step-100", NOW - 3 * DAY), Candidate("step-50", NOW - 60)]
    assert deleted(plan_retention(candidates, keep_last=5, keep_every=100, now=NOW)) == []
    assert deleted(plan_retention(candidates, keep_last=5, older_than=4 * DAY, now=NOW)) == []


def test_only_the_same_series_supersedes():
    """Another run under the same prefix, or another name pattern, is left out of it."""
    candidates = [
        Candidate("run1/step-100", NOW - 3 * DAY),
        Candidate("run2/step-50", NOW - 60),
        Candidate("best-90", NOW - 2 * DAY),
        Candidate("latest", NOW - 10),
    ]
    assert superseded(candidates) == {}
    assert series_of("run1/step-100") == "run1/step-#" and series_of("latest") is None


def test_busy_checkpoints_are_never_deleted():
    candidates = [Candidate("step-1", NOW - 2 * DAY, busy=True), *steps(2, 3)]
    decisions = {d.name: d for d in plan_retention(candidates, keep_last=1, now=NOW)}
    assert not decisions["step-1"].delete and decisions["step-1"].reason == "save in flight"
    assert decisions["step-2"].delete


def test_nothing_to_prune():
    assert plan_retention([], keep_last=3, now=NOW) == []
    assert deleted(plan_retention(steps(1, 2), keep_last=5, now=NOW)) == []


@pytest.mark.parametrize(
    "options",
    [{"keep_last": -1}, {"keep_last": 1, "keep_every": 0}, {"keep_last": 1, "older_than": -1.0}],
)
def test_invalid_policies_are_refused(options):
    with pytest.raises(ConfigError):
        plan_retention(steps(1), now=NOW, **options)


def _reference(candidates, keep_last, keep_every, older_than, force):
    """The rules restated as sets: deleted = all minus the union of everything protected
    (superseded ones: those with a lower step committed after them)."""

    def step(c):
        return int(c.name.split("-")[1])

    everything = sorted(candidates, key=step)
    replaced = {
        c.name for c in everything if any(step(d) < step(c) and d.time > c.time for d in everything)
    }
    ordered = [c for c in everything if c.name not in replaced]
    protected = (
        {c.name for c in ordered[max(0, len(ordered) - keep_last) :]} if keep_last else set()
    )
    if ordered and not force:
        protected.add(ordered[-1].name)
    if keep_every:
        protected |= {c.name for c in everything if step(c) % keep_every == 0}
    if older_than is not None:
        protected |= {c.name for c in everything if NOW - c.time <= older_than}
    return [c.name for c in everything if c.name not in protected]


def test_every_combination_matches_the_rules_restated():
    rng = random.Random(7)
    for count, keep_last, keep_every, older_than, force in itertools.product(
        range(7), range(5), (None, 1, 2, 3), (None, 0.0, 1.5 * DAY, 3 * DAY), (False, True)
    ):
        numbers = rng.sample(range(1, 30), count)
        candidates = [
            Candidate(f"step-{n}", NOW - rng.choice([0.5, 1, 2, 4]) * DAY) for n in numbers
        ]
        rng.shuffle(candidates)
        decisions = plan_retention(
            candidates,
            keep_last=keep_last,
            keep_every=keep_every,
            older_than=older_than,
            force=force,
            now=NOW,
        )
        expected = _reference(candidates, keep_last, keep_every, older_than, force)
        assert deleted(decisions) == expected, (numbers, keep_last, keep_every, older_than, force)
        assert len(decisions) == count
        deletion_reasons = ("expired", "superseded by step-")
        assert all(d.reason.startswith(deletion_reasons) for d in decisions if d.delete)
        assert not any(d.reason.startswith(deletion_reasons) for d in decisions if not d.delete)


@pytest.mark.parametrize("keep_last", [-1, 1.5, "3", True])
def test_prune_and_the_manager_refuse_the_same_keep_last(keep_last):
    with pytest.raises(ConfigError):
        plan_retention(steps(1), keep_last=keep_last, now=NOW)
    with pytest.raises(ConfigError):
        validate_options(keep_last, None, "wait", "thread")


def test_prune_and_the_manager_accept_keep_last_zero():
    assert deleted(plan_retention(steps(1, 2), keep_last=0, now=NOW)) == ["step-1"]
    validate_options(0, None, "wait", "thread")
