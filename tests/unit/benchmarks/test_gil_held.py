"""benchmarks.gil_held: GIL holds summed per thread from take_gil/drop_gil probe hits."""

from __future__ import annotations

import pytest

from benchmarks.gil_held import _holds, _takes, table


def test_a_hold_runs_from_a_take_to_the_same_threads_next_drop() -> None:
    events = [
        (1, 10.0, True),
        (2, 10.1, True),
        (1, 10.3, False),
        (2, 10.2, False),  # each thread's own drop ends its own hold
        (1, 10.5, True),
        (1, 10.6, False),
    ]
    held = _holds(events, [(9.0, 11.0)], {1: "caller", 2: "s3ckpt-io"})
    assert held["caller"] == pytest.approx(0.4)
    assert held["s3ckpt-io"] == pytest.approx(0.1)


def test_holds_count_inside_the_saves_only_and_threads_are_grouped() -> None:
    events = [
        (1, 1.0, True),
        (1, 2.5, False),  # began before the window: its half inside counts
        (3, 2.1, True),
        (3, 2.2, False),  # a native batch thread
        (4, 2.3, True),
        (4, 2.4, False),  # another one
        (5, 2.6, True),
        (5, 2.7, False),  # unnamed
        (6, 2.8, False),  # a drop with no take seen: perf attached mid-hold
        (1, 4.0, True),
        (1, 4.5, False),  # after the window
    ]
    names = {1: "save thread", 3: "s3ckpt-wire_0", 4: "s3ckpt-wire_1"}
    held = _holds(events, [(2.0, 3.0)], names)
    assert dict(held) == {
        "save thread": pytest.approx(0.5),
        "s3ckpt-wire": pytest.approx(0.2),
        "other": pytest.approx(0.1),
    }


def test_hits_that_do_not_pair_up_fail_the_run() -> None:
    """Lost probe hits would make holds look shorter or longer than they were."""
    lost = [(1, float(n), True) for n in range(10)] + [(1, 10.0, False)]
    with pytest.raises(RuntimeError, match="unpaired"):
        _holds(lost, [(0.0, 11.0)], {})
    with pytest.raises(RuntimeError, match="0 probe hits"):
        _holds([], [(0.0, 1.0)], {})


def test_the_table_has_a_row_per_mode_with_its_background_total() -> None:
    row = {
        "mode": "dcp_thread",
        "held_ms_per_save": {
            "caller": 140.0,
            "save thread": 60.0,
            "s3ckpt-io": 45.0,
            "uvloop_0": 3.0,
        },
        "background_ms_per_save": 108.0,
        "background_takes_per_save": 2750.4,
        "save_s": 1.1,
    }
    text = table([row], 6, "nested")
    line = next(line for line in text.splitlines() if line.startswith("dcp_thread"))
    assert line.split()[1:] == ["140.0", "60.0", "45.0", "0.0", "3.0", "108.0", "2750", "1.10"]


def test_takes_are_counted_per_thread_inside_the_saves() -> None:
    """Every take is a hand-over the loop beside pays for, however short the hold."""
    events = [
        (1, 1.0, True),  # before the window
        (1, 1.5, False),
        (2, 2.1, True),
        (2, 2.2, False),
        (3, 2.3, True),
        (3, 2.4, False),
        (4, 2.5, True),
        (4, 2.6, False),
        (2, 2.7, True),
        (2, 3.5, False),  # taken inside, dropped after: a take inside
        (2, 4.0, True),  # after the window
    ]
    names = {1: "caller", 2: "s3ckpt-io", 3: "s3ckpt-wire_0", 4: "s3ckpt-wire_1"}
    assert dict(_takes(events, [(2.0, 3.0)], names)) == {"s3ckpt-io": 2, "s3ckpt-wire": 2}
