"""``make bench`` (and ``python -m benchmarks.torch_checkpointing``): torch-checkpointing on S3.

One process saves and restores the same state (``--size-mib`` in ``--tensors`` tensors,
plus a step counter) three ways, each ``--reps`` times:

Each way keeps one manager (or stager) for all its saves, as a training run does; the
first save, which starts torch-checkpointing's checkpoint process, is reported apart.

* ``tc-tmpfs``: torch-checkpointing's asynchronous ``CheckpointManager`` with its own
  local-file backend on /dev/shm (no direct I/O: tmpfs has none): the no-network anchor;
* ``tc-s3``: the same manager through ``s3ckpt.integrations.torch_checkpointing``
  (``manager_config``) on the zero-cost S3 server (:mod:`benchmarks.zero_server`);
* ``dcp-s3``: ``dcp.async_save`` with ``S3StorageWriter`` and s3ckpt's ``HostStager``,
  loaded with ``dcp.load`` and ``S3StorageReader``, on the same server.

Per way: the time ``save`` blocks the caller (torch-checkpointing's returns before its
copy, so until ``lock()``, what guards the next optimizer step, lets go), the time until the checkpoint is committed
(background), and the restore. Ratios are against ``tc-tmpfs`` and ``dcp-s3``; nothing is
pass/fail. Output: a table and ``benchmarks/results/torch_checkpointing.json``.

    python -m benchmarks.torch_checkpointing [--size-mib 256] [--tensors 16] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
WAYS = ("tc-tmpfs", "tc-s3", "dcp-s3")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    report = measure(args.size_mib, args.tensors, args.reps)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "torch_checkpointing.json").write_text(json.dumps(report, indent=2))
    print(table(report))
    return 0


def measure(size_mib: int, tensors: int, reps: int) -> dict[str, Any]:
    from benchmarks.zero_server import ZeroS3

    state = _state(size_mib, tensors)
    runs: dict[str, list[dict[str, float]]] = {}
    exact: dict[str, bool] = {}
    local = Path(tempfile.mkdtemp(prefix="s3ckpt-bench-tc-", dir="/dev/shm"))
    try:
        with ZeroS3(pool_mib=min(3 * (reps + 1) * size_mib + 256, 6144)) as server:
            options = server.options()
            run = f"s3://{server.bucket}/tc-{int(time.time())}"
            for way in WAYS:
                runs[way], exact[way] = _way(way, state, reps + 1, local, run, options)
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return summarize(runs, exact, size_mib=size_mib, tensors=tensors, reps=reps)


def _state(size_mib: int, tensors: int) -> dict[str, Any]:
    import torch

    numel = size_mib * 2**20 // 4 // tensors
    g = torch.Generator().manual_seed(0)
    return {"model": {f"t{i}": torch.randn(numel, generator=g) for i in range(tensors)}, "step": 1}


def _empty(state: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0}


def _way(
    way: str, state: dict[str, Any], saves: int, local: Path, run: str, options: dict[str, Any]
) -> tuple[list[dict[str, float]], bool]:
    """``saves`` saves and restores one way, on one manager (the first save starts its
    checkpoint process: reported, left out of the medians)."""
    save, load, close = _ends(way, local, run, options)
    rows, exact = [], True
    try:
        for rep in range(saves):
            start = time.perf_counter()
            done = save(state, rep)
            blocked = time.perf_counter() - start
            done()
            committed = time.perf_counter() - start
            start = time.perf_counter()
            loaded = load(_empty(state), rep)
            restore = time.perf_counter() - start
            rows.append({"blocking": blocked, "background": committed, "restore": restore})
            exact = exact and _same(state, loaded)
    finally:
        close()
    return rows, exact


def _ends(way: str, local: Path, run: str, options: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``save(state, rep) -> wait``, ``load(into, rep) -> loaded`` and ``close()``."""
    if way == "dcp-s3":
        import torch.distributed.checkpoint as dcp

        from s3ckpt import HostStager, S3StorageReader, S3StorageWriter

        stager = HostStager()

        def dcp_save(state: dict[str, Any], rep: int) -> Any:
            writer = S3StorageWriter(f"{run}/dcp-{rep}", **options)
            future = dcp.async_save(state, storage_writer=writer, async_stager=stager)
            staged = getattr(future, "staging_completion", None)
            if staged is not None:
                staged.result()
            return (getattr(future, "upload_completion", None) or future).result

        def dcp_load(into: dict[str, Any], rep: int) -> dict[str, Any]:
            reader = S3StorageReader(f"{run}/dcp-{rep}", **options)
            dcp.load(into, storage_reader=reader, no_dist=True)
            return into

        return dcp_save, dcp_load, stager.close
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    from s3ckpt.integrations.torch_checkpointing import manager_config

    if way == "tc-tmpfs":
        manager = CheckpointManager(
            CheckpointManager.Config(storage_config=LocalFileSystemStorageConfig(False))
        )
        where = str(local)
    else:
        manager = CheckpointManager(manager_config(run, **options))
        where = run

    def tc_save(state: dict[str, Any], rep: int) -> Any:
        future = manager.save(f"{where}/tc-{rep}", state)
        with manager.lock():  # returns once the state is captured: what a loop waits for
            pass
        return future.result

    return tc_save, lambda into, rep: manager.load(f"{where}/tc-{rep}", into=into), manager.close


def _same(state: dict[str, Any], loaded: dict[str, Any]) -> bool:
    import torch

    return loaded["step"] == state["step"] and all(
        torch.equal(loaded["model"][k], v) for k, v in state["model"].items()
    )


def summarize(
    runs: dict[str, list[dict[str, float]]], exact: dict[str, bool], **shape: Any
) -> dict[str, Any]:
    medians = {
        way: {m: statistics.median(r[m] for r in rows[1:] or rows) for m in rows[0]}
        for way, rows in runs.items()
    }
    first = {way: rows[0] for way, rows in runs.items()}
    ratios = {
        f"tc-s3 / {anchor}": {m: medians["tc-s3"][m] / medians[anchor][m] for m in medians[anchor]}
        for anchor in ("tc-tmpfs", "dcp-s3")
    }
    return {
        "shape": shape, "seconds": medians, "first_save": first, "ratios": ratios,
        "exact": exact, "runs": runs,
    }  # fmt: skip


def table(report: dict[str, Any]) -> str:
    shape = report["shape"]
    lines = [
        f"torch-checkpointing on S3: {shape['size_mib']} MiB in {shape['tensors']} tensors, "
        f"one process, zero-cost S3 server (medians of {shape['reps']} saves after the first, "
        "seconds)",
        f"{'way':<10} {'blocking':>9} {'background':>11} {'restore':>8}  exact",
    ]
    for way, m in report["seconds"].items():
        lines.append(
            f"{way:<10} {m['blocking']:>9.3f} {m['background']:>11.3f} {m['restore']:>8.3f}"
            f"  {report['exact'][way]}"
        )
    for way, m in report["first_save"].items():
        lines.append(f"{way:<10} first save blocked {m['blocking']:.3f} s (its process starting)")
    for name, m in report["ratios"].items():
        lines.append(
            f"{name:<18} blocking {m['blocking']:.2f}x  background {m['background']:.2f}x  "
            f"restore {m['restore']:.2f}x"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
