"""``CommittedSteps``: each answer is found on rank 0 alone and shared with every rank."""

from __future__ import annotations

from typing import Any

import pytest

from s3ckpt.catalog.run_listing import steps_named
from s3ckpt.config import S3URI, S3Config
from s3ckpt.errors import BucketNotFoundError
from s3ckpt.manager import committed as committed_module
from s3ckpt.manager.committed import CommittedSteps
from s3ckpt.manager.policy import checkpoint_name

LOCATION = S3URI("bucket", "run")


class SharedRanks:
    """A rank of a group whose rank 0 gave ``answers``, in turn: what ``from_rank0``
    returns (or raises) on this rank; records what this rank handed it."""

    def __init__(self, rank: int, *answers: Any) -> None:
        self.rank = rank
        self.answers = list(answers)
        self.handed: list[Any] = []

    def from_rank0(self, outcome: Any) -> Any:
        self.handed.append(outcome)
        shared = outcome if self.rank == 0 else self.answers.pop(0)
        if isinstance(shared, BaseException):
            raise shared
        return shared


@pytest.fixture
def requests(monkeypatch) -> list[str]:
    """The store requests made: ``list`` for a listing of the run, the URI of each HEAD."""
    made: list[str] = []

    def run_steps(uri: str, **kwargs: Any):
        made.append("list")
        return steps_named({checkpoint_name(5): None, checkpoint_name(7): None})

    def is_committed(uri: str, **kwargs: Any) -> bool:
        made.append(uri)
        return True

    monkeypatch.setattr(committed_module.catalog, "run_steps", run_steps)
    monkeypatch.setattr(committed_module.catalog, "is_committed", is_committed)
    return made


def test_rank_0_lists_and_hands_its_answer_to_the_others(requests):
    ranks = SharedRanks(0)
    assert CommittedSteps(LOCATION, S3Config(), ranks).current() == [5, 7]  # type: ignore[arg-type]
    assert requests == ["list"]
    every, current, names = ranks.handed[0]
    assert every == frozenset({5, 7}) and current == [5, 7] and names == {}


def test_another_rank_asks_nothing_and_takes_rank_0s_answer(requests):
    ranks = SharedRanks(1, (frozenset({9}), [9], {9: "step-9"}), True)
    steps = CommittedSteps(LOCATION, S3Config(), ranks)  # type: ignore[arg-type]
    assert steps.current() == [9] and steps.name(9) == "step-9"
    assert steps.includes(9)  # listed: confirmed by rank 0's HEAD, shared
    assert requests == [] and ranks.handed == [None, None]


def test_rank_0s_error_is_raised_on_every_rank(requests, monkeypatch):
    error = BucketNotFoundError("no bucket")

    def broken(uri: str, **kwargs: Any):
        raise error

    monkeypatch.setattr(committed_module.catalog, "run_steps", broken)
    for ranks in (SharedRanks(0), SharedRanks(1, error)):
        with pytest.raises(BucketNotFoundError) as info:
            CommittedSteps(LOCATION, S3Config(), ranks).current()  # type: ignore[arg-type]
        assert info.value is error
