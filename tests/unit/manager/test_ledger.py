"""SaveLedger: what is recorded as a background save ends, on the thread that resolves it."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any

import pytest

from s3ckpt.errors import CheckpointExistsError, StorageError
from s3ckpt.manager.ledger import InFlight, SaveLedger
from s3ckpt.manager.policy import SaveMetrics


class Committed:
    def __init__(self) -> None:
        self.added: list[int] = []

    def add(self, steps: list[int]) -> None:
        self.added.extend(steps)


def _ledger(max_metrics: int = 10, on_saved: Any = None) -> tuple[SaveLedger, Committed]:
    committed = Committed()
    return SaveLedger(committed, max_metrics, on_saved), committed


def _ended(
    step: int, *, nbytes: int = 1000, error: BaseException | None = None, **kw: Any
) -> InFlight:
    """A save of ``step`` whose future has resolved (its state's bytes, or ``error``)."""
    future: Future[Any] = Future()
    if error is None:
        future.set_result(nbytes)
    else:
        future.set_exception(error)
    return InFlight(step, future, time.perf_counter(), 0.01, 0.0, **kw)


def test_a_commit_is_recorded_and_counted():
    ledger, committed = _ledger()
    inflight = _ended(4, nbytes=2_000)
    ledger.finished(inflight)
    assert inflight.done.is_set()
    assert inflight.metrics is not None and inflight.metrics.bytes == 2_000
    assert list(ledger.metrics) == [inflight.metrics]
    assert committed.added == [4]


def test_on_saved_is_read_as_each_save_ends_and_its_failure_is_only_logged(caplog):
    seen: list[tuple[str, int]] = []
    ledger, _ = _ledger(max_metrics=2, on_saved=lambda m: seen.append(("first", m.step)))
    ledger.finished(_ended(1))
    ledger.on_saved = lambda m: seen.append(("second", m.step))  # replaced between saves
    ledger.finished(_ended(2))

    def broken(metrics: SaveMetrics) -> None:
        raise ValueError("callback bug")

    ledger.on_saved = broken
    with caplog.at_level(logging.ERROR, logger="s3ckpt.manager"):
        ledger.finished(_ended(3))
    assert seen == [("first", 1), ("second", 2)]
    assert "on_saved callback failed for step 3" in caplog.text
    assert [m.step for m in ledger.metrics] == [2, 3]  # max_metrics kept


def test_a_save_held_only_in_memory_is_recorded_without_a_commit():
    ledger, committed = _ledger()
    inflight = _ended(5, to_s3=False, nbytes=0)
    inflight.nbytes = 3_000
    ledger.finished(inflight)
    assert inflight.metrics is not None and inflight.metrics.bytes == 3_000
    assert committed.added == []


def test_the_first_failure_is_raised_once_and_a_lost_race_is_not_one():
    ledger, committed = _ledger()
    ledger.finished(_ended(6, error=CheckpointExistsError("committed by another")))
    ledger.raise_failure()  # nothing to raise
    assert committed.added == [6]
    first, second = StorageError("first"), StorageError("second")
    ledger.finished(_ended(7, error=first))
    ledger.finished(_ended(8, error=second))
    with pytest.raises(StorageError) as raised:
        ledger.raise_failure()
    assert raised.value is first
    ledger.raise_failure()  # once
