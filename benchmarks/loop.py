"""``make bench`` (and ``python -m benchmarks.loop``): what a training loop loses to a save.

On the zero-cost S3 server (:mod:`benchmarks.zero_server`), each case in its own process
(:mod:`benchmarks.loop_cases`): two loops (``dispatch``: small torch ops and a little
Python, how a GPU trainer's Python thread launches kernels; ``compute``: a small MLP's
forward and backward), each alone, then beside every way of saving (s3ckpt's manager in
its default process mode and in thread mode, ``CheckpointProcess.async_save``,
``dcp.async_save`` with s3ckpt's writer in thread and process mode, and the peers: DCP's
``FileSystemWriter`` to /dev/shm and s3torchconnector's writer, thread mode; and the
floors, :mod:`benchmarks.loop_floors`: three for thread mode, one for the checkpoint
process); with the two cores shared by everything, then with the loop's thread alone on one core (everything else
on the other: the loop then competes for the GIL, not for a core). Reported per case: the
loop's slowdown during the upload, the upload's time, the time the save blocked, and the
loop time lost per GiB against a bare copy of the same bytes; and the slowdown's two
factors (:mod:`benchmarks.loop_cases`): ``waiting``, the loop's time off its core over
its CPU time (beside a thread-mode save, its waits for the GIL: what the save's threads
cost it), and ``cpu/step``, the growth of the loop's CPU time per step (what the host's
neighbours cost it, beside any mode), with the loop time lost counting the waiting alone.
Output: a table and ``benchmarks/results/loop.json`` (per case the medians, and every rep
in order).

    python -m benchmarks.loop [--size-mib 1024] [--reps 2] [--loops dispatch,compute]
                              [--modes ...] [--placements shared,pinned] [--state nested]
                              [--fork-cases]

``--fork-cases`` forks each case's process from one that imported the cases once
(:mod:`benchmarks.zygote`), for smoke runs: the case's own measures are the same, the
torch import is paid once.

The state is saved as trainers and the quickstart pass it to DCP, under one top-level
entry (``{"model": ...}``); ``--state flat`` saves its tensors as top-level entries
instead, where DCP's thread-mode ``save`` runs its per-entry logging and ``Stateful``
check once per tensor (:mod:`benchmarks.loop_cases`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from benchmarks.loop_cases import LOOPS, MODES, OTHERS_CPU, STATE_SHAPES
from benchmarks.zero_cost import _delete_prefix
from benchmarks.zero_server import ZeroS3
from benchmarks.zygote import Zygote

RESULTS = Path(__file__).resolve().parent / "results"
PLACEMENTS = ("shared", "pinned")
THREAD_MODES = ("manager_thread", "dcp_thread")
# What the cases import when they run, imported once where they are forked (--fork-cases).
LOOP_PRELOAD = ("s3ckpt.CheckpointManager", "s3ckpt.CheckpointProcess", "s3ckpt.S3StorageWriter",
                "s3ckpt.HostStager", "s3ckpt.ReusingSavePlanner")  # fmt: skip
# Targets with the loop alone on a core (docs/performance.md, "The loop beside a save").
DEFAULT_SLOWDOWN_MAX, DEFAULT_LOST_OVER_COPY_MAX, THREAD_SLOWDOWN_MAX = 0.05, 1.2, 0.20
# Each case's medians over its reps (benchmarks.loop_cases says what each measures).
MEDIANS = ("slowdown", "upload_s", "blocked_s", "lost_s_per_gib", "step_during_us",
           "step_cpu_during_us", "waiting", "lost_waiting_s_per_gib", "cpu_growth", "sleeps",
           "alone_drift", "lost_over_copy", "lost_waiting_over_copy", "blocked_over_copy")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--loops", default=",".join(LOOPS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--state", choices=STATE_SHAPES, default=STATE_SHAPES[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--fork-cases", action="store_true", help="fork each case from one process (smoke runs)"
    )
    args = parser.parse_args(argv)
    loops, modes = args.loops.split(","), args.modes.split(",")
    placements = args.placements.split(",")
    if not (set(loops) <= set(LOOPS) and set(modes) <= set(MODES)
            and set(placements) <= set(PLACEMENTS)):  # fmt: skip
        parser.error("unknown loop, mode or placement")
    if "pinned" in placements and len(os.sched_getaffinity(0)) < 2:
        parser.error("the pinned placement needs two CPUs")
    report = measure(
        loops, modes, placements, args.size_mib, args.reps, args.state, fork_cases=args.fork_cases
    )
    print(table(report))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loop.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out / 'loop.json'}", file=sys.stderr)
    return 0


def measure(
    loops: list[str],
    modes: list[str],
    placements: list[str],
    size_mib: int,
    reps: int,
    state: str = STATE_SHAPES[0],
    *,
    fork_cases: bool = False,
) -> dict[str, Any]:
    """Each case in a process of its own, in turn: a fresh interpreter, or (``fork_cases``)
    forked from one that imported the cases once (:mod:`benchmarks.zygote`)."""
    cases: list[dict[str, Any]] = []
    with ZeroS3(pool_mib=min((reps + 2) * size_mib + 256, 6144)) as server, \
            tempfile.TemporaryDirectory(prefix="s3ckpt-loop-") as tmp:  # fmt: skip
        env = {**os.environ, **server.env(), "BENCH_BUCKET": server.bucket,
               "BENCH_SIZE_MIB": str(size_mib), "BENCH_REPS": str(reps), "BENCH_TMP": tmp,
               "BENCH_STATE": state}  # fmt: skip
        forking = Zygote("benchmarks.loop_cases", env, LOOP_PRELOAD) if fork_cases else None
        with forking or nullcontext() as zygote:
            for placement in placements:
                _place_server(server, placement)
                for loop in loops:
                    for mode in ("alone", *modes):
                        prefix = f"loop-{int(time.time() * 1000)}"
                        case_env = {**env, "BENCH_PREFIX": prefix}
                        cases.append(_run(loop, mode, placement, case_env, zygote))
                        _delete_prefix(server, prefix)
    return {**summarize(cases, size_mib=size_mib, reps=reps), "state": state}


def _place_server(server: ZeroS3, placement: str) -> None:
    """Every thread of the server on the other core (pinned), or on all of them."""
    cpus = OTHERS_CPU if placement == "pinned" else os.sched_getaffinity(0)
    assert server.process is not None
    for task in os.listdir(f"/proc/{server.process.pid}/task"):
        os.sched_setaffinity(int(task), cpus)


def _run(
    loop: str, mode: str, placement: str, env: dict[str, str], zygote: Zygote | None = None
) -> dict[str, Any]:
    print(f"running {loop} beside {mode} ({placement}) ...", file=sys.stderr, flush=True)
    if zygote is not None:
        done = zygote.run([loop, mode, placement], env, timeout=1800)
    else:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.loop_cases", loop, mode, placement],
            env=env, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
    if done.returncode != 0 or not done.stdout.strip():
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        print(f"  failed:\n{tail}", file=sys.stderr)
        return {"loop": loop, "mode": mode, "placement": placement, "error": tail}
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(cases: list[dict[str, Any]], *, size_mib: int, reps: int) -> dict[str, Any]:
    """Per case the median over its reps; the targets."""
    rows = []
    for case in cases:
        row = {k: case.get(k) for k in ("loop", "mode", "placement", "error", "gib")}
        samples = case.get("reps") or []
        copies = [s["copy_s"] for s in samples] or ([case["copy_s"]] if "copy_s" in case else [])
        row["copy_s_per_gib"] = statistics.median(copies) / case["gib"] if copies else None
        for field in MEDIANS:  # each over-the-copy ratio within its rep, then the median
            row[field] = statistics.median(s[field] for s in samples) if samples else None
        # Full collections in the loop's interpreter during the uploads, over every rep.
        row["full_collections"] = sum(s["collections"][2] for s in samples) if samples else None
        for field in ("step_alone_us", "step_cpu_alone_us"):
            row[field] = (
                statistics.median(s[field] for s in samples) if samples else case.get(field)
            )
        row["reps"] = samples  # in order: a process's first timed save apart from the rest
        rows.append(row)
    report = {"size_mib": size_mib, "reps": reps, "cases": rows}
    report["targets"] = targets(rows)
    return report


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for row in rows:
        if row["placement"] != "pinned" or row.get("slowdown") is None:
            continue
        name = f"{row['loop']} beside {row['mode']}"
        # Each slowdown goal twice: on the slowdown itself, and on its waiting factor (the
        # slowdown where the loop's CPU per step stays as it was alone).
        if row["mode"] == "manager_default":
            found.append(_target(f"{name}: slowdown", row["slowdown"], DEFAULT_SLOWDOWN_MAX))
            found.append(_target(f"{name}: waiting", row.get("waiting"), DEFAULT_SLOWDOWN_MAX))
            found.append(_target(f"{name}: lost / copy", row.get("lost_over_copy"),
                                 DEFAULT_LOST_OVER_COPY_MAX))  # fmt: skip
            found.append(_target(f"{name}: lost waiting / copy",
                                 row.get("lost_waiting_over_copy"),
                                 DEFAULT_LOST_OVER_COPY_MAX))  # fmt: skip
            found.append(_target(f"{name}: blocked / copy", row.get("blocked_over_copy"),
                                 DEFAULT_LOST_OVER_COPY_MAX))  # fmt: skip
        if row["mode"] in THREAD_MODES:
            found.append(_target(f"{name}: slowdown", row["slowdown"], THREAD_SLOWDOWN_MAX))
            found.append(_target(f"{name}: waiting", row.get("waiting"), THREAD_SLOWDOWN_MAX))
    return found


def _target(name: str, value: float | None, goal: float) -> dict[str, Any]:
    return {"target": name, "value": value, "goal": goal,
            "met": value is not None and value <= goal}  # fmt: skip


def table(report: dict[str, Any]) -> str:
    head = (f"{'loop':<9} {'beside':<19} {'cores':<7} {'step us':>8} {'slowdown':>9} "
            f"{'waiting':>8} {'cpu/step':>9} {'sleeps':>7} {'drift':>6} "
            f"{'upload s':>9} {'blocked s':>10} {'lost s/GiB':>11} {'x copy':>7} {'waiting x':>10} "
            f"{'blocked x copy':>15} "
            f"{'full GCs':>9}")  # fmt: skip
    # Reports from before the option saved the flat state.
    shape = "one top-level entry" if report.get("state", "flat") == "nested" else "flat"
    lines = [f"The loop beside a save of {report['size_mib']} MiB ({shape}; median of "
             f"{report['reps']} reps; slowdown = (1 + waiting) x (1 + cpu/step) - 1: waiting, "
             "its time off its core over its CPU time; cpu/step, its CPU time per step over "
             "alone; sleeps, its waits in an upload; drift, its step alone after an upload over "
             "before; waiting x: the time lost counting only the waiting (blocked + upload x "
             "waiting / (1 + waiting)) over the copy; full GCs: the loop process's full "
             "garbage collections during the uploads, all reps)", head, "-" * len(head)]  # fmt: skip
    for row in report["cases"]:
        if row.get("error"):
            lines.append(f"{row['loop']:<9} {row['mode']:<19} {row['placement']:<7} failed")
            continue
        lines.append(
            f"{row['loop']:<9} {row['mode']:<19} {row['placement']:<7} "
            f"{_f(row['step_alone_us'], 1):>8} {_pct(row['slowdown']):>9} "
            f"{_pct(row.get('waiting')):>8} {_pct(row.get('cpu_growth')):>9} "
            f"{_f(row.get('sleeps'), 0):>7} {_pct(row.get('alone_drift')):>6} "
            f"{_f(row['upload_s'], 2):>9} {_f(row['blocked_s'], 3):>10} "
            f"{_f(row['lost_s_per_gib'], 3):>11} {_f(row.get('lost_over_copy'), 2):>7} "
            f"{_f(row.get('lost_waiting_over_copy'), 2):>10} "
            f"{_f(row.get('blocked_over_copy'), 2):>15} "
            f"{'-' if row.get('full_collections') is None else row['full_collections']:>9}"
        )
    lines += ["", "Targets (loop alone on a core):"]
    for t in report["targets"]:
        mark = "met" if t["met"] else "NOT met"
        lines.append(f"  {t['target']}: {_f(t['value'], 3)} (goal <= {t['goal']}) {mark}")
    return "\n".join(lines)


def _f(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.0f} %"


if __name__ == "__main__":
    sys.exit(main())
