"""One case of the ``durable`` benchmark: ``python -m benchmarks.durable_cases MODE``.

A user's training script, in a fresh process: it imports torch and s3ckpt, builds its
state, runs the dispatch loop (:func:`benchmarks.loop_cases.dispatch_loop`) alone for a
moment, constructs ``CheckpointManager(uri, keep_last=2, async_mode=...)`` and trains,
calling ``save`` every ``BENCH_EVERY_S`` seconds of training, ``BENCH_SAVES`` times, then
``close()`` at once after the last ``save`` returns (its upload still in flight). Printed
as one JSON line. ``MODE``: ``process`` (the default mode), ``thread``, or ``tier``
(process mode with a :class:`~s3ckpt.MemoryTier` on one node, every step to S3 too).

Per save, from the loop's clock (``time.perf_counter``): the ``save`` call, its return,
the commit (``on_saved``, on the manager's background thread), the copy held in the
memory tier and replicated to peers (the metrics' ``held_s``, ``replicated_s``: tier
only; one node has no peer to replicate to), and the time ``save`` waited for the save
before. A save's times to held and to committed count from its call, less that wait.
Every step of the loop is counted in one of five stretches: ``alone`` (before the manager
exists, after a short warm-up), ``startup`` (from construction to the first ``save``),
``first`` (the first save uploading), ``during`` (a later save uploading: the warm
uploads that the second and later saves start) and ``idle`` (nothing uploading after
the first commit).
Environment: ``BENCH_BUCKET``, ``BENCH_PREFIX``, ``BENCH_SIZE_MIB``, ``BENCH_SAVES``,
``BENCH_EVERY_S``, ``BENCH_ALONE_S``, ``BENCH_TMP`` (the memory tier's root goes under it),
and the endpoint's (``AWS_ENDPOINT_URL``...).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks.data import make_state, state_nbytes

warnings.filterwarnings("ignore")
MODES = ("process", "thread", "tier")
GiB = 1024**3


class Stretches:
    """The loop's steps, counted and timed per stretch."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.count[name] = self.count.get(name, 0) + 1
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def step_us(self, name: str) -> float | None:
        count = self.count.get(name, 0)
        return self.seconds[name] / count * 1e6 if count else None


def run(mode: str) -> dict[str, Any]:
    from benchmarks.loop_cases import dispatch_loop
    from s3ckpt import CheckpointManager, MemoryTier

    size_mib = int(os.environ.get("BENCH_SIZE_MIB", "256"))
    saves = int(os.environ.get("BENCH_SAVES", "4"))
    every = float(os.environ.get("BENCH_EVERY_S", "4"))
    alone_s = float(os.environ.get("BENCH_ALONE_S", "1"))
    uri = f"s3://{os.environ['BENCH_BUCKET']}/{os.environ['BENCH_PREFIX']}/{mode}"
    torch.set_num_threads(1)
    state = {"model": make_state(size_mib)}
    step = dispatch_loop()
    stretches = Stretches()
    clock = time.perf_counter
    warmed = clock() + 0.2  # a fresh interpreter's first steps are slower than its others
    while clock() < warmed:
        step()
    deadline = clock() + alone_s
    while clock() < deadline:
        started = clock()
        step()
        stretches.add("alone", clock() - started)

    committed: dict[int, tuple[float, Any]] = {}
    lock = threading.Lock()

    def on_saved(metrics: Any) -> None:
        with lock:
            committed[metrics.step] = (clock(), metrics)

    tier = None
    if mode == "tier":
        root = Path(os.environ["BENCH_TMP"]) / f"tier-{os.getpid()}"
        tier = MemoryTier(keep=2, s3_every=1, root=root, node="node0")
    async_mode = "thread" if mode == "thread" else "process"
    constructing = clock()
    manager = CheckpointManager(
        uri, keep_last=2, async_mode=async_mode, memory_tier=tier, on_saved=on_saved
    )
    constructed = clock()
    process = getattr(manager._saves, "process", None)  # None in thread mode
    ready_at: float | None = None
    calls: list[tuple[float, float]] = []  # (called, returned) per save
    for i in range(1, saves + 1):
        due = constructed + i * every
        while clock() < due:
            started = clock()
            step()
            took = clock() - started
            if i == 1:
                stretches.add("startup", took)
                if ready_at is None and process is not None and process.ready:
                    ready_at = clock()
            elif manager.busy:
                stretches.add("first" if i == 2 else "during", took)
            else:
                stretches.add("idle", took)
        called = clock()
        manager.save(i, state)
        calls.append((called, clock()))
        if i == saves:
            manager.close()
    closed = clock()
    saves_out = []
    for i, (called, returned) in enumerate(calls, start=1):
        at, metrics = committed[i]
        waited = metrics.waited_s
        begun = called + waited  # the save's own start, after any wait for the one before
        held = returned if metrics.held_s is None else returned + metrics.held_s
        replicated = None if metrics.replicated_s is None else returned + metrics.replicated_s
        saves_out.append({
            "step": i, "blocked_s": returned - called, "waited_s": waited,
            "to_held_s": held - begun, "to_committed_s": at - begun,
            "to_replicated_s": None if replicated is None else replicated - begun,
        })  # fmt: skip
    last_commit = committed[saves][0]
    alone = stretches.step_us("alone")
    return {
        "mode": mode, "gib": state_nbytes(state["model"]) / GiB, "every_s": every,
        "construct_s": constructed - constructing, "saves": saves_out,
        # construction to the checkpoint process ready (None: thread mode, or not
        # ready when the first save came)
        "ready_s": None if ready_at is None else ready_at - constructed,
        "close_s": closed - calls[-1][1],
        "close_after_commit_s": closed - max(last_commit, calls[-1][1]),
        "step_alone_us": alone,
        "startup_slowdown": _slowdown(stretches.step_us("startup"), alone),
        "first_upload_slowdown": _slowdown(stretches.step_us("first"), alone),
        "upload_slowdown": _slowdown(stretches.step_us("during"), alone),
        "idle_slowdown": _slowdown(stretches.step_us("idle"), alone),
        "steps": stretches.count,
        "warm_to_committed_s": statistics.median(s["to_committed_s"] for s in saves_out[1:])
        if saves > 1 else None,
    }  # fmt: skip


def _slowdown(during: float | None, alone: float | None) -> float | None:
    return None if during is None or not alone else during / alone - 1


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in MODES:
        sys.exit(f"usage: python -m benchmarks.durable_cases {{{','.join(MODES)}}}")
    print(json.dumps(run(sys.argv[1])), flush=True)
