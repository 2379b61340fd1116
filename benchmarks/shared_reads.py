"""Replicated loads, read once or by every replica: GET bytes over stored bytes, and time.

Spawns gloo ranks on this machine against the embedded SeaweedFS. Each layout loads a
checkpoint of full tensors: DDP (every rank a full copy) on 4 and 8 ranks, HSDP (2
replicas x 2 or 4 shards). Every load runs twice, with the reader given the group
(shared: each stored range is fetched once and passed on over gloo) and without (each
rank reads what it needs). Reported per case: GET bytes, counted in every rank at the
requests s3ckpt sends, over the checkpoint's stored bytes, and the load's wall time (the
slowest rank, between two barriers). A model extends the measured byte counts to the
Llama3-70B anchor (1,856 GPUs, 8-way sharding: 232 replicas). See ``docs/scale.md``.

    python -m benchmarks.shared_reads [--mib 256] [--cases ddp4,ddp8,hsdp2x2,hsdp2x4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from s3ckpt.testing.local_s3 import LocalS3Server

CASES = {
    "ddp4": ("ddp", 4, 1),
    "ddp8": ("ddp", 8, 1),
    "hsdp2x2": ("hsdp", 4, 2),
    "hsdp2x4": ("hsdp", 8, 4),
}


def _state(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    rows = 64
    per = mib * 1024 * 1024 // 4 // 4 // rows  # four fp32 tensors
    return {f"layer{i}": torch.randn(rows, per, generator=g) for i in range(4)}


def _count_gets() -> list[int]:
    """Bytes this rank asks the store for: ranged GETs as planned, whole objects as read."""
    from s3ckpt.s3.store import ObjectStore
    from s3ckpt.transfer import download

    total = [0]
    plan = download.plan_requests

    def counted(*args: Any, **kwargs: Any) -> Any:
        requests = plan(*args, **kwargs)
        total[0] += sum(r.end - r.start for r in requests)
        return requests

    download.plan_requests = counted  # type: ignore[assignment]
    get = ObjectStore.get

    async def whole(self: Any, key: str) -> bytes:
        body = await get(self, key)
        total[0] += len(body)
        return body

    ObjectStore.get = whole  # type: ignore[method-assign]
    return total


def _rank(rank: int, world: int, port: int, s3: dict[str, Any], uri: str, case: tuple, mib: int,
          out: str) -> None:  # fmt: skip
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from s3ckpt import S3StorageReader

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))  # fmt: skip
    layout, _, shards = case
    counted = _count_gets()
    results = {}
    try:
        full = _state(mib)
        mesh = None
        if layout == "hsdp":
            mesh = init_device_mesh("cpu", (world // shards, shards))
        for shared in (False, True):
            if mesh is None:
                target: dict[str, Any] = {k: torch.empty_like(v) for k, v in full.items()}
            else:
                target = {
                    k: distribute_tensor(torch.empty_like(v), mesh, [Replicate(), Shard(0)])
                    for k, v in full.items()
                }
            group = dist.group.WORLD if shared else None
            reader = S3StorageReader(uri, process_group=group, **s3)
            counted[0] = 0
            dist.barrier()
            started = time.perf_counter()
            dcp.load(target, storage_reader=reader)
            dist.barrier()
            elapsed = time.perf_counter() - started
            gets: list[int] = [0] * world
            dist.all_gather_object(gets, counted[0])
            results["shared" if shared else "unshared"] = {"s": elapsed, "get_bytes": sum(gets)}
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args(argv)
    import torch.distributed.checkpoint as dcp

    from s3ckpt import S3StorageWriter

    stored = sum(t.numel() * 4 for t in _state(args.mib).values())
    rows = []
    with LocalS3Server() as server, tempfile.TemporaryDirectory() as folder:
        s3 = {"endpoint_url": server.endpoint_url, "access_key_id": server.access_key,
              "secret_access_key": server.secret_key, "region": server.region}  # fmt: skip
        uri = f"s3://{server.bucket}/shared-reads-bench"
        dcp.save(_state(args.mib), storage_writer=S3StorageWriter(uri, **s3), no_dist=True)
        for name in args.cases.split(","):
            case = CASES[name]
            out = os.path.join(folder, f"{name}.json")
            tmp.start_processes(_rank, args=(case[1], _free_port(), s3, uri, case, args.mib, out),
                                nprocs=case[1], start_method="spawn")  # fmt: skip
            result = json.loads(Path(out).read_text())
            rows.append((name, result))
    print(f"checkpoint: {stored / 2**20:.0f} MiB stored\n")
    print("| case | GET bytes / stored, shared | unshared | load s, shared | unshared |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, r in rows:
        s, u = r["shared"], r["unshared"]
        print(f"| {name} | {s['get_bytes'] / stored:.3f} | {u['get_bytes'] / stored:.3f} "
              f"| {s['s']:.2f} | {u['s']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
