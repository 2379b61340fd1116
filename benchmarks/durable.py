"""``make bench`` (and ``python -m benchmarks.durable``): how soon a save is durable.

On the zero-cost S3 server (:mod:`benchmarks.zero_server`), each case a user's script in
a fresh process (:mod:`benchmarks.durable_cases`): ``CheckpointManager(keep_last=2)``
constructed beside the dispatch loop, a save every ``--every-s`` seconds of training,
``close()`` right after the last one. Per mode (``process``, the default; ``thread``;
``tier``, process mode with the memory tier on one node) and per load level (0, 1, 2
busy processes at nice 0 beside it, and ``cores - 1`` where that is more: what a
trainer's data-loader workers do to a node), modes taking turns within each round.

Reported per case, best and median over the rounds: the constructor's time; the first
save's time from ``save()`` to held (the copy made, or held in the memory tier), to
replicated (tier, with peers on other nodes) and to committed; the warm saves' time to
committed (median over a case's saves after the first); the loop's blocking at the second
save (what a save due while the first is still uploading costs); the loop's slowdown
after construction (the checkpoint process starting beside it), during the first upload
and during the warm uploads (against the loop alone before the manager existed);
``close()``, called as the last save returns, and its time after the last commit. Then the ratios process / thread per load
level and a verdict on the targets (docs/performance.md, "Time to durable"): process
mode's time to committed within 1.2x thread mode's, first save included, and ``close()``
within 1 s of the last commit. The verdict is printed; nothing fails on it. Output: a
table, a Markdown table for the docs, and ``benchmarks/results/durable.json``.

    python -m benchmarks.durable [--size-mib 256] [--reps 2] [--loads 0,1,2]
                                 [--modes process,thread,tier] [--every-s 4] [--saves 4]
                                 [--fork-cases]

``--fork-cases`` forks each case's process from one that imported the case module once
(:mod:`benchmarks.zygote`), for smoke runs: the script's torch import is paid once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from benchmarks.durable_cases import MODES
from benchmarks.zero_cost import _delete_prefix
from benchmarks.zero_server import ZeroS3
from benchmarks.zygote import Zygote

RESULTS = Path(__file__).resolve().parent / "results"
COMMITTED_RATIO_MAX, CLOSE_AFTER_COMMIT_MAX = 1.2, 1.0
# What each row shows: (field, label, format); each as "best / median" over the rounds.
MEASURES = (
    ("construct_s", "construct s", "{:.2f}"),
    ("ready_s", "ready s", "{:.2f}"),
    ("first_to_held_s", "1st held s", "{:.2f}"),
    ("first_to_replicated_s", "1st repl. s", "{:.2f}"),
    ("first_to_committed_s", "1st commit s", "{:.2f}"),
    ("warm_to_committed_s", "warm commit s", "{:.2f}"),
    ("second_blocked_s", "2nd blocked s", "{:.2f}"),
    ("startup_slowdown", "startup slow", "{:+.0%}"),
    ("first_upload_slowdown", "1st upl. slow", "{:+.0%}"),
    ("upload_slowdown", "upload slow", "{:+.0%}"),
    ("close_s", "close s", "{:.2f}"),
    ("close_after_commit_s", "close-commit s", "{:.2f}"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--loads", default=None, help="busy processes beside each case")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--every-s", type=float, default=4.0)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--alone-s", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--fork-cases", action="store_true", help="fork each case from one process (smoke runs)"
    )
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    loads = default_loads() if args.loads is None else [int(n) for n in args.loads.split(",")]
    if not set(modes) <= set(MODES) or args.saves < 2 or min(loads) < 0:
        parser.error("unknown mode, fewer than two saves, or a negative load")
    report = measure(modes, loads, args)
    print(table(report))
    print()
    print(markdown(report))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "durable.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out / 'durable.json'}", file=sys.stderr)
    return 0


def default_loads() -> list[int]:
    """0, 1 and 2 busy processes, and one per core but the loop's where that is more."""
    return sorted({0, 1, 2, len(os.sched_getaffinity(0)) - 1})


def measure(modes: list[str], loads: list[int], args: argparse.Namespace) -> dict[str, Any]:
    cases: list[dict[str, Any]] = []
    pool = min((args.saves + 2) * args.size_mib + 256, 6144)
    with ZeroS3(pool_mib=pool) as server, \
            tempfile.TemporaryDirectory(prefix="s3ckpt-durable-") as tmp:  # fmt: skip
        env = {**os.environ, **server.env(), "BENCH_BUCKET": server.bucket,
               "BENCH_SIZE_MIB": str(args.size_mib), "BENCH_SAVES": str(args.saves),
               "BENCH_EVERY_S": str(args.every_s), "BENCH_ALONE_S": str(args.alone_s)}  # fmt: skip
        forking = Zygote("benchmarks.durable_cases", env) if args.fork_cases else None
        with forking or nullcontext() as zygote:
            for load in loads:
                with busy_processes(load):
                    for rep in range(args.reps):
                        for mode in modes if rep % 2 == 0 else modes[::-1]:  # taking turns
                            prefix = f"durable-{int(time.time() * 1000)}"
                            case_tmp = tempfile.mkdtemp(dir=tmp)
                            case_env = {**env, "BENCH_PREFIX": prefix, "BENCH_TMP": case_tmp}
                            found = _run(mode, load, case_env, zygote)
                            cases.append({**found, "load": load, "rep": rep})
                            shutil.rmtree(case_tmp, ignore_errors=True)
                            _delete_prefix(server, prefix)
    report = summarize(cases, modes=modes, loads=loads)
    report.update(size_mib=args.size_mib, reps=args.reps, every_s=args.every_s,
                  saves=args.saves, cpus=len(os.sched_getaffinity(0)))  # fmt: skip
    return report


@contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` processes spinning in pure Python at nice 0 (where this one runs at
    another nice value and may set it), for as long as the block runs."""
    spin = (
        "import os\ntry:\n    os.setpriority(os.PRIO_PROCESS, 0, 0)\n"
        "except PermissionError:\n    pass\nwhile True:\n    pass\n"
    )
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def _run(mode: str, load: int, env: dict[str, str], zygote: Zygote | None = None) -> dict[str, Any]:
    print(f"running {mode} beside {load} busy ...", file=sys.stderr, flush=True)
    if zygote is not None:
        done = zygote.run([mode], env, timeout=900)
    else:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.durable_cases", mode],
            env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
    if done.returncode != 0 or not done.stdout.strip():
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        print(f"  failed:\n{tail}", file=sys.stderr)
        return {"mode": mode, "error": tail}
    return json.loads(done.stdout.strip().splitlines()[-1])


def flatten(case: dict[str, Any]) -> dict[str, float | None]:
    """One case's measures, as :data:`MEASURES` names them."""
    first, second = case["saves"][0], case["saves"][1]
    return {
        "construct_s": case["construct_s"],
        "ready_s": case.get("ready_s"),
        "first_to_held_s": first["to_held_s"],
        "first_to_replicated_s": first["to_replicated_s"],
        "first_to_committed_s": first["to_committed_s"],
        "warm_to_committed_s": case["warm_to_committed_s"],
        "second_blocked_s": second["blocked_s"],
        "startup_slowdown": case["startup_slowdown"],
        "first_upload_slowdown": case["first_upload_slowdown"],
        "upload_slowdown": case["upload_slowdown"],
        "close_s": case["close_s"],
        "close_after_commit_s": case["close_after_commit_s"],
    }


def summarize(cases: list[dict[str, Any]], *, modes: list[str], loads: list[int]) -> dict[str, Any]:
    """Per (mode, load): each measure's best and median over the rounds; the ratios
    process / thread and the targets."""
    rows = []
    for load in loads:
        for mode in modes:
            mine = [c for c in cases if c["mode"] == mode and c["load"] == load]
            good = [flatten(c) for c in mine if not c.get("error")]
            row: dict[str, Any] = {"mode": mode, "load": load, "runs": len(good),
                                   "errors": [c["error"] for c in mine if c.get("error")]}  # fmt: skip
            for field, _, _ in MEASURES:
                values = [m[field] for m in good if m[field] is not None]
                row[field] = (
                    {"best": min(values), "median": statistics.median(values)} if values else None
                )
            rows.append(row)
    return {"rows": rows, "ratios": ratios(rows), "targets": targets(rows), "cases": cases}


def _row(rows: list[dict[str, Any]], mode: str, load: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["mode"] == mode and r["load"] == load), None)


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Process mode over thread mode, per load level, on the medians."""
    found = []
    for load in sorted({r["load"] for r in rows}):
        process, thread = _row(rows, "process", load), _row(rows, "thread", load)
        if process is None or thread is None:
            continue
        entry: dict[str, Any] = {"load": load}
        for field in ("construct_s", "first_to_committed_s", "warm_to_committed_s",
                      "second_blocked_s", "close_s"):  # fmt: skip
            p, t = process.get(field), thread.get(field)
            entry[field] = p["median"] / t["median"] if p and t and t["median"] > 0 else None
        found.append(entry)
    return found


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for entry in ratios(rows):
        for field, name in (("first_to_committed_s", "first save"),
                            ("warm_to_committed_s", "warm saves")):  # fmt: skip
            found.append(_target(
                f"{entry['load']} busy: process / thread time to committed, {name}",
                entry[field], COMMITTED_RATIO_MAX,
            ))  # fmt: skip
    for row in rows:
        close = row.get("close_after_commit_s")
        found.append(_target(
            f"{row['load']} busy, {row['mode']}: close() after the last commit, s",
            close["median"] if close else None, CLOSE_AFTER_COMMIT_MAX,
        ))  # fmt: skip
    return found


def _target(name: str, value: float | None, goal: float) -> dict[str, Any]:
    return {"target": name, "value": value, "goal": goal,
            "met": value is not None and value <= goal}  # fmt: skip


def _cell(value: dict[str, float] | None, fmt: str) -> str:
    if value is None:
        return "-"
    return f"{fmt.format(value['best'])} / {fmt.format(value['median'])}"


def table(report: dict[str, Any]) -> str:
    width = 15
    head = f"{'mode':<8} {'busy':>4} " + " ".join(f"{label:>{width}}" for _, label, _ in MEASURES)
    lines = [
        f"Time to durable, {report['size_mib']} MiB, one rank, a save every "
        f"{report['every_s']:g} s of training, {report['saves']} saves a case, "
        f"{report['cpus']} CPUs (best / median of {report['reps']} rounds; repl.: one node "
        "has no peer to replicate to)",
        head, "-" * len(head),
    ]  # fmt: skip
    for row in report["rows"]:
        cells = " ".join(f"{_cell(row[f], fmt):>{width}}" for f, _, fmt in MEASURES)
        failed = f"  ({len(row['errors'])} failed)" if row["errors"] else ""
        lines.append(f"{row['mode']:<8} {row['load']:>4} {cells}{failed}")
    lines += ["", "process / thread (medians):"]
    for entry in report["ratios"]:
        parts = [f"{k} {_ratio(v)}" for k, v in entry.items() if k != "load"]
        lines.append(f"  {entry['load']} busy: " + ", ".join(parts))
    lines += ["", "Verdict (printed, not a test):"]
    for t in report["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"  {t['target']}: {value} (goal <= {t['goal']}) "
                     f"{'met' if t['met'] else 'NOT met'}")  # fmt: skip
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(report: dict[str, Any]) -> str:
    """The docs' table: medians (best in brackets where they differ)."""
    labels = [label for _, label, _ in MEASURES if label != "1st repl. s"]
    lines = ["| mode | busy | " + " | ".join(labels) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in labels) + " |"]  # fmt: skip
    for row in report["rows"]:
        cells = []
        for field, label, fmt in MEASURES:
            if label == "1st repl. s":
                continue
            value = row[field]
            cells.append("-" if value is None else fmt.format(value["median"]).replace("%", " %"))
        lines.append(f"| {row['mode']} | {row['load']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
