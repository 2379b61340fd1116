"""``s3ckpt memory``: what this node's memory tier holds (:mod:`s3ckpt.tier`), and
removing a run's copies from it.

Reads the descriptors under the root (no torch, no S3): one row per held copy, the run it
belongs to, its step, rank and size. ``--verify`` also checks every copy against its
CRC32Cs; ``--rm URI`` frees a run's copies (for a run that is over: its copies outlive
its processes by design).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from s3ckpt.background.held import MappedCopy
from s3ckpt.cli.commands import emit
from s3ckpt.cli.humanize import human_bytes, human_duration, iso_time, table
from s3ckpt.tier.copies import node_copies, remove_run
from s3ckpt.tier.options import default_root


def memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="the tier's root (default: $S3CKPT_MEMORY_ROOT, else /dev/shm/s3ckpt)",
    )
    parser.add_argument("--verify", action="store_true", help="check each copy's CRC32Cs")
    parser.add_argument("--rm", metavar="URI", help="remove every copy of the run saved to URI")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run_memory(args: argparse.Namespace) -> int:
    """Exit 1 when ``--verify`` finds a damaged copy."""
    args.root = args.root or default_root()
    if args.rm:
        freed = remove_run(args.root, args.rm)
        print(f"removed the copies of {args.rm} under {args.root}: {human_bytes(freed)} freed")
        return 0
    copies = node_copies(args.root) if args.root.is_dir() else []
    problems = {c.folder: _verify(c.folder, c.held) for c in copies} if args.verify else {}
    now = time.time()
    rows = [
        (
            c.run, c.held.step, f"{c.held.rank}/{c.held.world}", human_bytes(c.held.nbytes),
            human_duration(now - c.held.created),
            ("damaged" if problems[c.folder] else "intact") if args.verify else None,
            c.folder,
        )
        for c in copies
    ]  # fmt: skip
    document = [
        {
            "run": c.run, "step": c.held.step, "rank": c.held.rank, "world": c.held.world,
            "lineage": c.held.lineage, "bytes": c.held.nbytes, "created": iso_time(c.held.created), "folder": str(c.folder),
            **({"problem": problems[c.folder]} if args.verify else {}),
        }
        for c in copies
    ]  # fmt: skip
    headers = ("RUN", "STEP", "RANK", "SIZE", "AGE", "CHECK", "FOLDER")
    emit(args, document, table(headers, rows, right=(1, 3)) if copies else "")
    if not copies and not args.json:
        print(f"no copies held under {args.root}", file=sys.stderr)
    for folder, problem in problems.items():
        if problem:
            print(f"s3ckpt: memory: {folder}: {problem}", file=sys.stderr)
    return 1 if any(problems.values()) else 0


def _verify(folder: Path, held: object) -> str | None:
    try:
        copy = MappedCopy(folder, held)  # type: ignore[arg-type]
    except (OSError, ValueError) as exc:
        return str(exc)
    try:
        return copy.verify()
    finally:
        copy.close()
