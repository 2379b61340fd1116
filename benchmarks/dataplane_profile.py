"""Where s3ckpt's client CPU goes, by stage, on the zero-cost server.

``python -m benchmarks.dataplane_profile [--size-mib 1024] [--reps 2]`` saves and loads
the benchmark state with s3ckpt in this process and reads every thread's CPU time from
``/proc/self/task`` around each, so the CPU-seconds per GiB are split by thread exactly
(the DCP caller, s3ckpt's I/O loop, worker threads). Where ``py-spy`` is installed it
samples the process meanwhile, and each thread's CPU is divided among stages in
proportion to its samples (:data:`STAGES`, first match from the innermost frame out).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

GiB = 1024**3
RESULTS = Path(__file__).resolve().parent / "results"
# (stage, substrings of a frame that put a sample there): checked innermost frame first.
STAGES = [
    ("CRC32C of blocks", ("format/checksums.py",)),
    ("socket writes and reads (kernel copies, loopback TCP)",
     ("http_writer.py", "StreamWriter._write", "sock_sendall", "s3/wire/exchange.py",
      "s3/wire/get_exchange.py", "s3/wire/pool.py", "s3/wire/on_loop.py",
      "EventLoopThread._run")),
    ("botocore/aiobotocore: build, sign, parse requests", ("botocore/",)),
    ("DCP planning and metadata (torch)", ("torch/distributed/checkpoint",)),
    ("s3ckpt transfer and bookkeeping", ("s3ckpt/",)),
]  # fmt: skip
OTHER = "other (event loop, asyncio, interpreter)"


def thread_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of every thread of this process, by native id."""
    ticks = os.sysconf("SC_CLK_TCK")
    result = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        result[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
    return result


def thread_names() -> dict[int, str]:
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    return {
        tid: ("main (DCP caller)" if name == "MainThread" else name) for tid, name in names.items()
    }


class Sampler:
    """py-spy recording this process (raw folded stacks, per thread), or nothing."""

    def __init__(self, out: Path) -> None:
        self.out = out
        tool = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        self.process = None
        if Path(tool).exists():
            command = [tool, "record", "--pid", str(os.getpid()), "--nonblocking", "--threads",
                       "--rate", "250", "--format", "raw", "--output", str(out)]  # fmt: skip
            self.process = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            time.sleep(1.0)  # attached before the work starts

    def stop(self) -> dict[int, collections.Counter[str]]:
        """Samples per thread id and stage."""
        if self.process is None:
            return {}
        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=60)
        samples: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        if not self.out.exists():
            return {}
        for line in self.out.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            tid = _tid(frames[0])
            if tid is not None:
                samples[tid][_stage(frames[1:])] += int(count)
        return samples


def _tid(frame: str) -> int | None:
    """The native thread id in py-spy's thread frame, ``thread (1234): name``."""
    inside = frame[frame.rfind("(") + 1 : frame.rfind(")")].split(":")[0].strip()
    try:
        return int(inside, 0)
    except ValueError:
        return None


def _stage(frames: list[str]) -> str:
    for frame in reversed(frames):
        for stage, marks in STAGES:
            if any(mark in frame for mark in marks):
                return stage
    return OTHER


def profile(operation: str, run: Any, nbytes: int, reps: int, scratch: Path) -> dict[str, Any]:
    """CPU-s/GiB of ``run`` (called ``reps`` times), by thread and by stage."""
    sampler = Sampler(scratch / f"{operation}.txt")
    before, started = thread_cpu(), time.perf_counter()
    for i in range(reps):
        run(i)
    wall, after = time.perf_counter() - started, thread_cpu()
    samples = sampler.stop()
    names, gib = thread_names(), nbytes * reps / GiB
    by_thread = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    stages: collections.Counter[str] = collections.Counter()
    threads: dict[str, float] = collections.Counter()
    for tid, cpu in by_thread.items():
        if cpu <= 0:
            continue
        threads[names.get(tid, "worker threads")] += cpu / gib
        counts = samples.get(tid)
        if counts:
            total = sum(counts.values())
            for stage, n in counts.items():
                stages[stage] += cpu / gib * n / total
        else:
            stages["unsampled threads (C: crc32c, torch, uvloop)"] += cpu / gib
    return {
        "mbps": nbytes * reps / wall / 1e6,
        "cpu_s_per_gib": sum(by_thread.values()) / gib,
        "threads": dict(threads),
        "stages": dict(stages.most_common()),
        "sampled": bool(samples),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    import torch.distributed.checkpoint as dcp

    from benchmarks.data import empty_like_state, make_state, state_nbytes
    from benchmarks.zero_server import ZeroS3
    from s3ckpt import S3StorageReader, S3StorageWriter

    state = make_state(args.size_mib)
    target, nbytes = empty_like_state(state), state_nbytes(state)
    with (
        ZeroS3(pool_mib=args.size_mib * args.reps + 256) as server,
        tempfile.TemporaryDirectory() as tmp,
    ):
        options = server.options()
        uri = f"s3://{server.bucket}/profile/rep{{}}"
        dcp.save(
            {"warm": state["layers.0.norm0"]},
            storage_writer=S3StorageWriter(uri.format("warm"), **options),
        )
        report = {
            "size_mib": args.size_mib,
            "reps": args.reps,
            "save": profile("save", lambda i: dcp.save(state, storage_writer=S3StorageWriter(uri.format(i), **options)),
                            nbytes, args.reps, Path(tmp)),
            "load": profile("load", lambda i: dcp.load(target, storage_reader=S3StorageReader(uri.format(i), **options)),
                            nbytes, args.reps, Path(tmp)),
        }  # fmt: skip
    for operation in ("save", "load"):
        entry = report[operation]
        print(
            f"s3ckpt dcp.{operation}: {entry['mbps']:.0f} MB/s, {entry['cpu_s_per_gib']:.2f} CPU-s/GiB"
        )
        for name, value in sorted(entry["threads"].items(), key=lambda kv: -kv[1]):
            print(f"  thread {name:<40}{value:>6.2f}")
        for name, value in entry["stages"].items():
            print(f"  stage  {name:<56}{value:>6.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dataplane_profile.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
