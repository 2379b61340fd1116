"""How the number of background threads that take the GIL changes what a loop loses:
``python -m benchmarks.gil_convoy``.

The dispatch loop of ``benchmarks.loop_cases`` steps alone on CPU 0, then beside
background work on CPU 1: ``--items`` times a stretch of Python (``--python-us``) then a
1 MiB CRC32C that lets the GIL go, the same work done by one thread, then split over two
and three. Each thread that wants the GIL back waits beside the loop's, and a release
wakes one of them, so the loop waits behind more of the background's stretches as the
threads multiply, with the same total work (docs/decisions/0008-thread-mode-gil.md).
Needs two CPUs.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch
from crc32c import crc32c

from benchmarks.loop_cases import LOOP_CPU, OTHERS_CPU, dispatch_loop


def _python(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    spins = 0
    while time.perf_counter() < end:
        spins += 1


def _background(items: int, python_us: float, block: bytearray) -> None:
    os.sched_setaffinity(0, OTHERS_CPU)
    for _ in range(items):
        _python(python_us)
        crc32c(block, 0, gil_release_mode=1)


def measure(threads: int, items: int, python_us: float) -> tuple[float, float]:
    """The loop's slowdown beside ``threads`` threads sharing ``items``, and their time."""
    step = dispatch_loop()
    os.sched_setaffinity(0, LOOP_CPU)
    started, count = time.perf_counter(), 0
    while time.perf_counter() - started < 1.0:
        step()
        count += 1
    alone = (time.perf_counter() - started) / count
    block = bytearray(1 << 20)
    workers = [
        threading.Thread(target=_background, args=(items // threads, python_us, block))
        for _ in range(threads)
    ]
    for worker in workers:
        worker.start()
    started, count = time.perf_counter(), 0
    while any(worker.is_alive() for worker in workers):
        step()
        count += 1
    elapsed = time.perf_counter() - started
    for worker in workers:
        worker.join()
    return elapsed / max(count, 1) / alone - 1, elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=4000)
    parser.add_argument("--python-us", type=float, default=50.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        parser.error("needs two CPUs")
    torch.set_num_threads(1)
    print("threads  slowdown  background s")
    for _ in range(args.rounds):
        for threads in (1, 2, 3):
            slowdown, elapsed = measure(threads, args.items, args.python_us)
            print(f"{threads:7d}  {slowdown * 100:+7.0f} %  {elapsed:12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
