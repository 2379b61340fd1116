"""``python -m benchmarks.mlperf_checkpoint``: MLPerf Storage's checkpoint workload, scaled.

MLPerf Storage v2.0 measures storage with DLIO's checkpointing workload: a model's
checkpoint (fp16 weights and fp32 optimizer state: 2 + 12 bytes per parameter) split
evenly over its ranks, written ``--checkpoints`` times (10), then read back as many
times; the reported figures are, per operation, the slowest rank's duration and the
smallest rank's throughput. The models and the rank counts they are run on:

========== ======== =============================================
model       ranks    per rank (2 + 12 bytes x parameters / ranks)
========== ======== =============================================
llama3-8b   8        about 13 GiB
llama3-70b  64       about 14 GiB
llama3-405b 512      about 10 GiB
llama3-1t   1,024    about 17 GiB (DLIO's shape: 1.3 T parameters)
========== ======== =============================================

(parameter counts from the transformer shapes of DLIO's workload configurations). This
machine runs ``--ranks`` gloo processes (2), each with the per-rank state of ``--model``
scaled by ``--scale`` so that it fits; the scale is printed with the figures. Each rank
saves its own shard (ZeRO-3: no two ranks hold the same bytes) in one ``dcp.save`` through
``S3StorageWriter``, to the zero-cost S3 server (:mod:`benchmarks.zero_server`), then loads
it with ``S3StorageReader``. Output: a table and ``benchmarks/results/mlperf_checkpoint.json``.

    python -m benchmarks.mlperf_checkpoint [--model llama3-8b] [--ranks 2] [--scale 0.01]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
BYTES_PER_PARAMETER = 2 + 12  # fp16 weights; fp32 master weights and two Adam moments
TENSOR_BYTES = 64 * 2**20  # a shard is cut into tensors of at most this size


@dataclass(frozen=True)
class Model:
    """A transformer as DLIO's workload configurations describe it."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    ranks: int  # the ranks MLPerf Storage runs it on

    @property
    def parameters(self) -> int:
        head = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head
        layer = attention + 3 * self.hidden * self.ffn + 2 * self.hidden
        return self.layers * layer + 2 * self.vocab * self.hidden + self.hidden

    @property
    def bytes_per_rank(self) -> int:
        return self.parameters * BYTES_PER_PARAMETER // self.ranks


MODELS = {
    "llama3-8b": Model(32, 4096, 14336, 32, 8, 128256, ranks=8),
    "llama3-70b": Model(80, 8192, 28672, 64, 8, 128256, ranks=64),
    "llama3-405b": Model(126, 16384, 53248, 128, 8, 128256, ranks=512),
    "llama3-1t": Model(128, 25872, 98304, 32, 32, 128256, ranks=1024),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--scale", type=float, default=0.01)
    parser.add_argument("--checkpoints", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    model = MODELS[args.model]
    rank_bytes = max(int(model.bytes_per_rank * args.scale), 2**20)
    report = measure(args.ranks, rank_bytes, args.checkpoints)
    report["workload"] = {
        "model": args.model,
        "parameters": model.parameters,
        "mlperf_ranks": model.ranks,
        "mlperf_bytes_per_rank": model.bytes_per_rank,
        "scale": args.scale,
        "ranks": args.ranks,
        "bytes_per_rank": rank_bytes,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mlperf_checkpoint.json").write_text(json.dumps(report, indent=2))
    print(table(report))
    return 0


def measure(ranks: int, rank_bytes: int, checkpoints: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.multiprocessing as tmp

    from benchmarks.zero_server import ZeroS3

    pool = min(ranks * rank_bytes * (checkpoints + 1) // 2**20 + 256, 8192)
    with ZeroS3(pool_mib=pool) as server, tempfile.TemporaryDirectory() as out:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        s3 = server.options()
        uri = f"s3://{server.bucket}/mlperf-{int(time.time())}"
        args = (ranks, store.port, s3, uri, out, rank_bytes, checkpoints)
        tmp.start_processes(_rank, args=args, nprocs=ranks, join=True, start_method="spawn")
        per_rank = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(ranks)]
    return summarize(per_rank, rank_bytes)


def _rank(
    rank: int, world: int, port: int, s3: dict[str, Any], uri: str, out: str,
    rank_bytes: int, checkpoints: int,
) -> None:  # fmt: skip
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from s3ckpt import S3StorageReader, S3StorageWriter

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    state = _shard(rank, rank_bytes)
    timings: dict[str, list[float]] = {"write": [], "read": []}
    for n in range(checkpoints):
        dist.barrier()
        start = time.perf_counter()
        dcp.save(state, storage_writer=S3StorageWriter(f"{uri}/ckpt-{n}", **s3))
        timings["write"].append(time.perf_counter() - start)
    exact = True
    for n in range(checkpoints):
        target = {k: torch.empty_like(v) for k, v in state.items()}
        dist.barrier()
        start = time.perf_counter()
        dcp.load(target, storage_reader=S3StorageReader(f"{uri}/ckpt-{n}", **s3))
        timings["read"].append(time.perf_counter() - start)
        exact = exact and all(torch.equal(target[k], v) for k, v in state.items())
    Path(out, f"rank{rank}.json").write_text(json.dumps({**timings, "exact": exact}))
    dist.destroy_process_group()


def _shard(rank: int, rank_bytes: int) -> dict[str, Any]:
    """One rank's part: fp16 weights (1/7 of the bytes) and fp32 optimizer state."""
    import torch

    g = torch.Generator().manual_seed(rank)
    parts = {"model": (rank_bytes * 2 // BYTES_PER_PARAMETER, torch.float16)}
    parts["optimizer"] = (rank_bytes - parts["model"][0], torch.float32)
    state = {}
    for name, (nbytes, dtype) in parts.items():
        size = dtype.itemsize
        for n, start in enumerate(range(0, nbytes, TENSOR_BYTES)):
            count = min(TENSOR_BYTES, nbytes - start) // size
            state[f"rank{rank}.{name}.{n}"] = torch.randn(count, generator=g).to(dtype)
    return state


def summarize(per_rank: list[dict[str, Any]], rank_bytes: int) -> dict[str, Any]:
    """MLPerf's way: per operation the slowest rank's duration and the smallest rank's
    throughput (each rank's bytes over its own duration), then their means over the
    checkpoints; also the aggregate (every rank's bytes over the slowest duration)."""
    figures = {}
    for kind in ("write", "read"):
        slowest = [max(r[kind][n] for r in per_rank) for n in range(len(per_rank[0][kind]))]
        smallest = [min(rank_bytes / r[kind][n] for r in per_rank) for n in range(len(slowest))]
        figures[kind] = {
            "slowest_rank_s": statistics.mean(slowest),
            "smallest_rank_GBps": statistics.mean(smallest) / 1e9,
            "aggregate_GBps": statistics.mean(len(per_rank) * rank_bytes / s for s in slowest)
            / 1e9,
            "runs": len(slowest),
        }
    return {"figures": figures, "exact": all(r["exact"] for r in per_rank)}


def table(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [
        f"MLPerf Storage checkpoint workload, {w['model']} ({w['parameters'] / 1e9:.1f} B "
        f"parameters, {w['mlperf_bytes_per_rank'] / 2**30:.1f} GiB per rank on "
        f"{w['mlperf_ranks']} ranks), scaled by {w['scale']}: {w['bytes_per_rank'] / 2**20:.0f} "
        f"MiB per rank on {w['ranks']} ranks, zero-cost S3 server",
        f"{'operation':<10} {'slowest rank s':>15} {'smallest rank GB/s':>19} {'aggregate GB/s':>15}",
    ]
    for kind, f in report["figures"].items():
        lines.append(
            f"{kind:<10} {f['slowest_rank_s']:>15.3f} {f['smallest_rank_GBps']:>19.3f} "
            f"{f['aggregate_GBps']:>15.3f}"
        )
    lines.append(f"bit-exact reads: {report['exact']} (means of {f['runs']} runs each)")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
