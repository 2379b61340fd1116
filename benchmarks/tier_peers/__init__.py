"""Peers' in-memory checkpoint tiers, measured like :mod:`benchmarks.memory_tier` (one per module).

Each module runs in its peer's own environment (torch and the peer, nothing of s3ckpt's):
``rank_main`` is one spawned rank, :func:`run_pair` the two of a run.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_pair(
    name: str, rank_main: Callable[..., None], size_mib: int, tensors: int, saves: int,
    out: Path | None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Spawn ``rank_main(rank, 2, port, root, out, size_mib, tensors, saves)`` on two ranks
    (a folder of /dev/shm as their root, removed after) and return their reports
    (``<out>/<name>-rank<r>.json``)."""
    import torch.distributed as dist
    import torch.multiprocessing as tmp

    root = Path(tempfile.mkdtemp(prefix=f"s3ckpt-bench-{name}-", dir="/dev/shm"))
    try:
        reports = out or root / "reports"
        reports.mkdir(parents=True, exist_ok=True)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        args = (2, store.port, str(root), str(reports), size_mib, tensors, saves)
        tmp.start_processes(rank_main, args=args, nprocs=2, join=True, start_method="spawn")
        return [json.loads((reports / f"{name}-rank{r}.json").read_text()) for r in range(2)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
