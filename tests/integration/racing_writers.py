"""The test's side of a race of writer processes (``_commit_race_worker.py``): the processes
run and are stopped, how each round ended is collected, and each round has one winner."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections import defaultdict
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def running(processes: list[multiprocessing.process.BaseProcess]) -> Iterator[None]:
    """The processes started; on leaving, each joined (a minute at most) or killed."""
    for process in processes:
        process.start()
    try:
        yield
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()


def outcomes(results: Any, count: int, timeout_s: float) -> dict[int, dict[int, str]]:
    """``count`` reports ``(round, writer, outcome)`` from ``results``: round -> writer ->
    outcome, each report awaited ``timeout_s`` at most."""
    ended: dict[int, dict[int, str]] = defaultdict(dict)
    for _ in range(count):
        number, writer, outcome = results.get(timeout=timeout_s)
        ended[number][writer] = outcome
    return ended


def one_winner(number: int, ended: dict[int, str]) -> int:
    """The writer that committed round ``number``; every other one lost with a conflict."""
    winners = [w for w, outcome in ended.items() if outcome == "committed"]
    assert len(winners) == 1, (number, ended)
    losers = [o for w, o in ended.items() if w not in winners]
    assert all(o.startswith("CommitConflictError") for o in losers), (number, ended)
    return winners[0]
