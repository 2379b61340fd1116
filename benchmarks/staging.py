"""``make bench`` (and ``python -m benchmarks.staging``): what a save blocks the loop for.

``CheckpointManager.save`` in its default mode returns once the state is copied into the
staging memory it shares with its checkpoint process; that copy, and the Python around it
(walking the state, describing the copy to the process), is all the loop waits for. Here,
on the zero-cost S3 server (:mod:`benchmarks.zero_server`), the blocking time of steady
saves (after two that fill the staging memory) against a bare copy of the same tensors
into buffers allocated beforehand, for two states: the benchmark model
(:func:`benchmarks.data.make_state`, ``--size-mib`` in 580 tensors: the copy dominates)
and ``--small`` tensors of 4 KiB (the Python per tensor dominates; a large model's state
and optimizer hold thousands of tensors). Reported: medians, their ratio, and the time per
tensor beyond the copy. The target for the first (docs/performance.md, "The loop beside a
save"): blocking within 1.2x the bare copy. Output: a table and
``benchmarks/results/staging.json``.

    python -m benchmarks.staging [--size-mib 1024] [--small 5000] [--saves 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.data import bare_copy_s, make_state
from benchmarks.zero_server import ZeroS3

RESULTS = Path(__file__).resolve().parent / "results"
BLOCKING_MAX = 1.2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--small", type=int, default=5000)
    parser.add_argument("--saves", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.saves < 3:
        parser.error("--saves must be at least 3 (two fill the staging memory)")
    torch.set_num_threads(1)
    states = {
        f"model, {args.size_mib} MiB": make_state(args.size_mib),
        f"{args.small} tensors of 4 KiB": {f"t{i}": torch.randn(1024) for i in range(args.small)},
    }
    with ZeroS3(pool_mib=min(2 * args.size_mib + 256, 6144)) as server:
        os.environ.update(server.env())
        cases = [
            measure(name, state, f"s3://{server.bucket}/staging-{i}", args.saves)
            for i, (name, state) in enumerate(states.items())
        ]
    report = {"benchmark": "staging", "cases": cases}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "staging.json").write_text(json.dumps(report, indent=2))
    print(table(report))
    return 0


def measure(name: str, state: dict[str, torch.Tensor], uri: str, saves: int) -> dict[str, Any]:
    from s3ckpt import CheckpointManager

    blocked = []
    with CheckpointManager(uri, endpoint_url=os.environ["AWS_ENDPOINT_URL"]) as manager:
        for step in range(saves):
            started = time.perf_counter()
            manager.save(step, state)
            blocked.append(time.perf_counter() - started)
            manager.wait()
    steady = statistics.median(blocked[2:])
    copy = bare_copy_s(state)
    return {
        "state": name,
        "tensors": len(state),
        "bytes": sum(t.nbytes for t in state.values()),
        "blocked_s": steady,
        "copy_s": copy,
        "blocked_over_copy": steady / copy,
        "us_per_tensor_beyond_copy": (steady - copy) / len(state) * 1e6,
    }


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{'state':<28} {'tensors':>8} {'blocked s':>10} {'copy s':>8} {'ratio':>6} "
        f"{'us/tensor':>10}"
    ]
    for case in report["cases"]:
        lines.append(
            f"{case['state']:<28} {case['tensors']:>8} {case['blocked_s']:>10.4f} "
            f"{case['copy_s']:>8.4f} {case['blocked_over_copy']:>6.2f} "
            f"{case['us_per_tensor_beyond_copy']:>10.1f}"
        )
    lines.append(f"target: the model's blocking within {BLOCKING_MAX}x the bare copy")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
