"""s3ckpt.background.priority: when other work fills the node's cores beside a save."""

from __future__ import annotations

import collections
import subprocess
import sys
import threading
import time

import pytest

from s3ckpt.background import priority
from s3ckpt.background.priority import Contention, others_fill_the_cores, runnable_threads

SPIN = "import threading\nwhile True: pass"
# two threads hashing with the GIL let go: both runnable at once
SPIN_TWO = """\
import hashlib, threading
data = bytes(64 << 20)
def spin():
    while True:
        hashlib.sha256(data).digest()
threading.Thread(target=spin).start()
spin()
"""
SLEEP = "import time\ntime.sleep(60)"


@pytest.fixture
def processes():
    started: list[subprocess.Popen[bytes]] = []

    def start(code: str) -> subprocess.Popen[bytes]:
        started.append(subprocess.Popen([sys.executable, "-c", code]))
        return started[-1]

    yield start
    for process in started:
        process.kill()
        process.wait()


@pytest.mark.parametrize(
    ("samples", "cores", "filled"),
    [
        ([], 2, False),  # nothing sampled yet
        ([1, 1, 1, 1], 2, False),  # the loop alone on one of two cores
        ([1, 2, 1, 2], 2, True),  # on average 1.5 of 2: less than half a core idle
        ([2, 2, 2, 2], 2, True),  # the loop and one busy process
        ([16, 16, 16, 16], 16, True),  # cores - 1 busy beside the loop
        ([15, 15, 15, 15], 16, False),  # one core idle
        ([14, 14, 15, 14], 16, False),
        ([0, 0, 0, 9], 2, True),  # a burst counts by its average
    ],
)
def test_others_fill_the_cores_by_their_average(samples, cores, filled):
    assert others_fill_the_cores(collections.deque(samples), cores) is filled


def _sampled_max(pid: int, seconds: float = 1.0) -> int:
    most, ends = 0, time.monotonic() + seconds
    while time.monotonic() < ends:
        most = max(most, runnable_threads(pid))
        time.sleep(0.02)
    return most


@pytest.mark.subprocess
def test_runnable_threads_counts_a_process_s_running_threads(processes):
    sleeper = processes(SLEEP)
    ends = time.monotonic() + 30  # runnable while its interpreter starts, then asleep
    while runnable_threads(sleeper.pid) and time.monotonic() < ends:
        time.sleep(0.05)
    assert runnable_threads(sleeper.pid) == 0
    two = processes(SPIN_TWO)
    time.sleep(0.5)  # the interpreter's start-up, then both threads spin
    assert _sampled_max(two.pid) == 2
    assert runnable_threads(2**22 + 12345) == 0  # no such process


@pytest.mark.subprocess
def test_contention_says_when_others_fill_the_cores_and_when_the_watch_ends(processes):
    """Two spinning processes on a node taken as one core: contended within the window;
    the end of the watch says it is over (the next save starts from a fresh window)."""
    saver = processes(SLEEP)  # stands for the checkpoint process: its threads not counted
    seen: list[bool] = []
    changed = threading.Event()

    def record(contended: bool) -> None:
        seen.append(contended)
        changed.set()

    contention = Contention(saver.pid, record, cores=1)
    try:
        processes(SPIN)
        processes(SPIN)
        contention.watch(True)
        assert changed.wait(priority.WINDOW * priority.SAMPLE_EVERY_S + 10), seen
        assert seen == [True]
        changed.clear()
        contention.watch(False)
        assert changed.wait(priority.SAMPLE_EVERY_S + 10), seen
        assert seen == [True, False]
    finally:
        contention.stop()


@pytest.mark.subprocess
def test_contention_is_quiet_where_a_core_stays_idle(processes):
    """A node taken as many cores more than it has: nothing fills them, nothing is said."""
    saver = processes(SLEEP)
    seen: list[bool] = []
    contention = Contention(saver.pid, seen.append, cores=10_000)
    try:
        contention.watch(True)
        time.sleep(priority.WINDOW * priority.SAMPLE_EVERY_S * 2)
        contention.watch(False)
    finally:
        contention.stop()
    assert seen == []
