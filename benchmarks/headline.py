"""docs/performance.md's headline table, rendered from the last ``python -m benchmarks.run``.

Reads ``benchmarks/results/bench.json`` and rewrites what lies between the two marker
comments in ``docs/performance.md``: s3ckpt's save and load against its peers and the raw
ceilings of the same run (throughput, client CPU per GiB, throughput as a share of the
ceiling), with the run's date and machine. ``make bench`` runs it last, on the machine that
ran the benchmarks, so a run that recorded no machine is described by this one.

    python -m benchmarks.headline [--results benchmarks/results/bench.json] [--page docs/performance.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import textwrap
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "bench.json"
PAGE = ROOT / "docs" / "performance.md"
START = "<!-- headline: start (rendered by `python -m benchmarks.headline`; edits here are replaced) -->"
END = "<!-- headline: end -->"

# (case in bench.json, label); the first row of each operation is its ceiling.
SAVES = [
    ("raw_upload", "raw multipart upload (ceiling)"),
    ("s3ckpt_save", "**s3ckpt `dcp.save`**"),
    ("s3ckpt_async", "s3ckpt `dcp.async_save` (to completion)"),
    ("s3torch_save", "s3torchconnector"),
    ("fsspec_save", "FsspecWriter + s3fs"),
    ("filesystem_save", "FileSystemWriter, local disk"),
]
LOADS = [
    ("raw_download", "raw ranged GETs (ceiling)"),
    ("s3ckpt_load", "**s3ckpt `dcp.load`**"),
    ("s3torch_load", "s3torchconnector"),
    ("fsspec_load", "FsspecReader + s3fs"),
    ("filesystem_load", "FileSystemReader, local disk"),
]


def render(report: dict[str, Any], *, date: str, machine: str) -> str:
    """The table, in Markdown, for one run's ``report`` (bench.json's ``"report"``)."""
    cases = report["cases"]
    lines = [
        _prose(
            f"{date}, {machine}: `python -m benchmarks.run --size-mib {report['size_mib']} "
            f"--reps {report['reps']}` (the median of {report['reps']} runs per case, against "
            "the embedded SeaweedFS server on the same machine)."
        ),
        "",
        "| | MB/s | client CPU-s/GiB | MB/s / ceiling |",
        "| --- | ---: | ---: | ---: |",
    ]
    for operation, rows in (("save", SAVES), ("load", LOADS)):
        lines.append(f"| *{operation}* | | | |")
        ceiling = cases.get(rows[0][0], {}).get("mbps_median")
        for case, label in rows:
            lines.append(_row(label, cases.get(case), ceiling))
    memcpy = cases.get("memcpy", {})
    staged = cases.get("s3ckpt_async", {})
    if "seconds_median" in memcpy and "blocked_median_after_first_s" in staged:
        blocked = staged["blocked_median_after_first_s"]
        lines += [
            "",
            _prose(
                f"`dcp.async_save` blocked the caller {blocked:.2f} s a save from the second "
                f"on, {blocked / memcpy['seconds_median']:.2f}x a bare copy of the state into "
                f"preallocated buffers ({memcpy['seconds_median']:.2f} s)."
            ),
        ]
    return "\n".join(lines)


def _prose(text: str) -> str:
    """A paragraph wrapped as the page's prose is."""
    return textwrap.fill(text, width=92, break_long_words=False, break_on_hyphens=False)


def _row(label: str, entry: dict[str, Any] | None, ceiling: float | None) -> str:
    if entry is None:
        return f"| {label} | not run | | |"
    if "mbps_median" not in entry:
        why = entry.get("skipped") or entry.get("error") or "no result"
        return f"| {label} | {why} | | |"
    share = f"{entry['mbps_median'] / ceiling:.2f}" if ceiling else ""
    return f"| {label} | {entry['mbps_median']:,.0f} | {entry['cpu_s_per_gib']:.2f} | {share} |"


def replace_between_markers(page: str, table: str) -> str:
    """``page`` with everything between START and END replaced by ``table``."""
    head, start, rest = page.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"the page lacks the markers {START!r} and {END!r}")
    return f"{head}{START}\n{table}\n{END}{tail}"


def describe_machine() -> str:
    """This machine: its CPU model (or architecture), core count and memory."""
    model = platform.machine()
    memory = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        total_kib = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal:")
        )
        memory = f", {total_kib / 1024**2:.0f} GiB of memory"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{model}, {os.cpu_count()} cores{memory}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--page", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    if not args.results.exists():
        print(f"{args.results} not found: run `python -m benchmarks.run` first", file=sys.stderr)
        return 1
    report = json.loads(args.results.read_text())["report"]
    ran = datetime.fromtimestamp(args.results.stat().st_mtime, tz=timezone.utc)
    date = report.get("date") or ran.strftime("%Y-%m-%d")
    machine = report.get("machine") or describe_machine()
    table = render(report, date=date, machine=machine)
    args.page.write_text(replace_between_markers(args.page.read_text(), table))
    print(f"rewrote the headline table of {args.page}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
