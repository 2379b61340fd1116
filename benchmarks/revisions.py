"""The same benchmark cases on two revisions of s3ckpt, in one run: ``python -m benchmarks.revisions``.

A change to the data path is judged by its tables measured before and after it, on the
same machine in the same stretch of time: run-to-run noise on a shared 2-core VM is about
±15 %, more than most changes. This checks the base revision out into a temporary git
worktree and runs ``benchmarks.run`` (SeaweedFS, HTTP and HTTPS) or ``benchmarks.zero_cost``
(the zero-cost server) there and in the working tree, taking turns ``--rounds`` times, and
prints each case's median over the rounds side by side, with the ratio of after to before.

    python -m benchmarks.revisions --base 4ac29ad5 --tool run --size-mib 512 --reps 2 \\
        --cases s3ckpt_save,s3ckpt_load,s3ckpt_save_https,s3ckpt_load_https
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# What each tool reports per case: (label, field in its JSON, lower is better).
FIELDS = {
    "run": [("MB/s", "mbps_median", False), ("CPU-s/GiB", "cpu_s_per_gib", True),
            ("RSS MiB", "rss_over_baseline_mib", True)],
    "zero_cost": [("MB/s", "mbps_best", False), ("CPU-s/GiB", "cpu_s_per_gib_best", True),
                  ("server CPU-s/GiB", "server_cpu_s_per_gib", True)],
}  # fmt: skip
OUTPUT = {"run": "bench.json", "zero_cost": "dataplane.json"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True, help="the revision to compare against")
    parser.add_argument("--tool", choices=sorted(FIELDS), default="run")
    parser.add_argument("--cases", required=True)
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="turns each revision takes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="s3ckpt-revisions-") as tmp:
        base = _worktree(args.base, Path(tmp) / "base")
        try:
            runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
            for round_ in range(args.rounds):
                for label, tree in (("before", base), ("after", ROOT)):
                    out = Path(tmp) / f"{label}-{round_}"
                    print(f"round {round_ + 1}: {label} ({tree})", file=sys.stderr, flush=True)
                    runs[label].append(_measure(tree, args, out))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT)
    print(table(args, runs))
    return 0


def _worktree(revision: str, path: Path) -> Path:
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(path), revision], cwd=ROOT, check=True
    )
    for built in (ROOT / "s3ckpt").rglob("*.so"):  # the compiled extensions
        shutil.copy2(built, path / built.relative_to(ROOT))
    return path


def _measure(tree: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", f"benchmarks.{args.tool}", "--size-mib", str(args.size_mib),
               "--reps", str(args.reps), "--cases", args.cases, "--out", str(out)]  # fmt: skip
    if args.tool == "zero_cost":
        command.append("--no-parallel")
    subprocess.run(command, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    report = json.loads((out / OUTPUT[args.tool]).read_text())
    cases: dict[str, Any] = report.get("report", report)["cases"]
    return cases


def table(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> str:
    """Each case's median over the rounds, before and after, and after / before."""
    fields = FIELDS[args.tool]
    header = ["case"] + [
        f"{name} {side}" for name, _, _ in fields for side in ("before", "after", "ratio")
    ]
    lines = [f"{args.tool}, {args.size_mib} MiB, {args.reps} reps x {args.rounds} rounds, "
             f"before = {args.base}, after = working tree", "| " + " | ".join(header) + " |",
             "| --- " + "| ---: " * (len(header) - 1) + "|"]  # fmt: skip
    for case in args.cases.split(","):
        row = [case]
        for _, field, _ in fields:
            before = _median(runs["before"], case, field)
            after = _median(runs["after"], case, field)
            ratio = after / before if before and after is not None else None
            row += [_fmt(before), _fmt(after), "-" if ratio is None else f"{ratio:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _median(runs: list[dict[str, Any]], case: str, field: str) -> float | None:
    values = [r[case][field] for r in runs if field in r.get(case, {})]
    return statistics.median(values) if values else None


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
