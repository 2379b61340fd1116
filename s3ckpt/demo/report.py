"""The demo's summary: the loss curve across the crash and what checkpointing cost.

Both training runs append JSON lines (``kind`` = ``step``, ``save`` or ``resume``); this
module reads them back and turns them into the numbers the demo promises: the loss
continuing where it left off (the steps trained twice must give the same losses), mean
step time with and without a checkpoint in progress, blocked seconds per save, and
upload throughput. Pure functions over the records, so they are easy to check.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from s3ckpt.units import human_bytes, human_rate

WARMUP_STEPS = 5  # first steps of each process: allocator and kernel warm-up, not training
_BARS = "▁▂▃▄▅▆▇█"


def read_events(path: Path) -> list[dict[str, Any]]:
    """The records of one run; a line cut short by SIGKILL is dropped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def of_kind(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") == kind]


@dataclass(frozen=True)
class Continuity:
    """How run 2's losses compare with run 1's on the steps both trained."""

    resumed_from: int
    overlap: list[int]  # steps after the checkpoint that run 1 had trained before the kill
    max_difference: float

    @property
    def identical(self) -> bool:
        return bool(self.overlap) and self.max_difference <= 1e-4


def continuity(run1: list[dict[str, Any]], run2: list[dict[str, Any]], resumed: int) -> Continuity:
    first = {r["step"]: r["loss"] for r in of_kind(run1, "step")}
    second = {r["step"]: r["loss"] for r in of_kind(run2, "step")}
    overlap = sorted(s for s in first if s in second and s > resumed)
    diff = max((abs(first[s] - second[s]) for s in overlap), default=0.0)
    return Continuity(resumed, overlap, diff)


def loss_table(
    run1: list[dict[str, Any]], run2: list[dict[str, Any]], resumed: int, killed: int
) -> list[str]:
    """Loss per step around the restart, both runs side by side."""
    first = {r["step"]: r["loss"] for r in of_kind(run1, "step")}
    second = {r["step"]: r["loss"] for r in of_kind(run2, "step")}
    wanted = [resumed - 1, resumed, resumed + 1, resumed + 2, killed - 1, killed, killed + 1]
    wanted += [killed + 2]
    lines = ["   step   run 1 (killed)   run 2 (resumed)"]
    previous = None
    for step in sorted({s for s in wanted if s in first or s in second}):
        if previous is not None and step > previous + 1:
            lines.append("    ...")
        previous = step
        note = {resumed: "  <- last commit before the kill", killed: "  <- SIGKILL during its save"}
        left = f"{first[step]:.4f}" if step in first else "-"
        right = f"{second[step]:.4f}" if step in second else "-"
        lines.append(f"  {step:5d}   {left:>14}   {right:>15}{note.get(step, '')}")
    return lines


def sparkline(losses: list[float], width: int = 60) -> str:
    """The curve in block characters, ``width`` buckets of mean loss."""
    if not losses:
        return ""
    size = max(1, -(-len(losses) // width))
    buckets = [mean(losses[i : i + size]) for i in range(0, len(losses), size)]
    low, high = min(buckets), max(buckets)
    span = (high - low) or 1.0
    return "".join(_BARS[min(7, int((b - low) / span * 8))] for b in buckets)


def merged_curve(
    run1: list[dict[str, Any]], run2: list[dict[str, Any]], resumed: int
) -> list[float]:
    """The loss the finished model went through: run 1 up to the checkpoint, then run 2."""
    curve = {r["step"]: r["loss"] for r in of_kind(run1, "step") if r["step"] <= resumed}
    curve.update({r["step"]: r["loss"] for r in of_kind(run2, "step")})
    return [curve[s] for s in sorted(curve)]


@dataclass(frozen=True)
class Timing:
    clean_s: float  # mean step time with no checkpoint in progress
    overall_s: float  # mean step time over every step, saves included
    saves: int
    blocked_mean_s: float
    blocked_max_s: float
    upload_mean_s: float
    throughput_mb_s: float  # total bytes over total upload seconds
    megabytes: float  # per checkpoint

    @property
    def overhead_pct(self) -> float:
        return 100.0 * (self.overall_s / self.clean_s - 1.0) if self.clean_s else 0.0


def timing(runs: list[list[dict[str, Any]]]) -> Timing:
    steps = [r for run in runs for r in of_kind(run, "step")[WARMUP_STEPS:]]
    clean = [r["dt"] for r in steps if not r["ckpt"]]
    saves = [r for run in runs for r in of_kind(run, "save")]
    upload = sum(s["upload_s"] for s in saves)
    nbytes = sum(s["bytes"] for s in saves)
    return Timing(
        clean_s=mean(clean) if clean else 0.0,
        overall_s=mean(r["dt"] for r in steps) if steps else 0.0,
        saves=len(saves),
        blocked_mean_s=mean(s["blocked_s"] for s in saves) if saves else 0.0,
        blocked_max_s=max((s["blocked_s"] for s in saves), default=0.0),
        upload_mean_s=upload / len(saves) if saves else 0.0,
        throughput_mb_s=nbytes / 1e6 / upload if upload else 0.0,
        megabytes=nbytes / 1e6 / len(saves) if saves else 0.0,
    )


def continuity_line(result: Continuity, killed: int) -> str:
    if not result.overlap:
        return f"step {killed} committed before the kill landed: nothing was trained twice"
    verdict = "identical" if result.identical else "DIFFERENT"
    return (
        f"steps {result.overlap[0]}-{result.overlap[-1]} were trained twice (before the crash, "
        f"and again after resuming from step-{result.resumed_from:010d}): losses {verdict} "
        f"(largest difference {result.max_difference:.2e})"
    )


def summary_lines(
    run1: list[dict[str, Any]], run2: list[dict[str, Any]], resumed: int, killed: int, total: int
) -> list[str]:
    result = continuity(run1, run2, resumed)
    t = timing([run1, run2])
    curve = merged_curve(run1, run2, resumed)
    steps_run = len(of_kind(run1, "step")) + len(of_kind(run2, "step"))
    return [
        f"loss curve, steps 1-{total}: {curve[0]:.3f} {sparkline(curve)} {curve[-1]:.3f}",
        *loss_table(run1, run2, resumed, killed),
        continuity_line(result, killed),
        "",
        f"steps              {total} to train, {steps_run} run ({steps_run - total} redone after the crash)",
        f"checkpoints        {t.saves} committed ({human_bytes(t.megabytes * 1e6)} each), 1 "
        "interrupted by SIGKILL",
        f"mean step time     {1000 * t.clean_s:.0f} ms with no checkpoint in progress, "
        f"{1000 * t.overall_s:.0f} ms overall with checkpoints (overhead {t.overhead_pct:+.1f}%)",
        f"blocked per save   {t.blocked_mean_s:.3f} s mean, {t.blocked_max_s:.3f} s max "
        "(the loop waits only for the copy to host memory)",
        f"upload             {t.upload_mean_s:.2f} s per checkpoint in the background, "
        f"{human_rate(t.throughput_mb_s * 1e6)}",
    ]
