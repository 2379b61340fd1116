"""Rank entry point for the two-rank TieredCheckpointProcess test (ranks over
gloo, each rank's memory root a simulated node's): a dcp.async_save-style script that
names its own S3 checkpoints, its saves held, replicated and every second one uploaded;
a node lost; everything lost but S3."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _manager_worker import make_state, reporting_rank, same_state, snapshot, train_step


def tiered_process_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], uri: str, out_dir: str,
    roots: list[str],
) -> None:  # fmt: skip
    from s3ckpt import (
        ConfigError,
        MemoryTier,
        S3StorageReader,
        S3StorageWriter,
        TieredCheckpointProcess,
    )

    tier = MemoryTier(keep=2, s3_every=2, root=Path(roots[rank]), node=f"node{rank}")
    model, state = make_state(rank, seed=1)
    expected: dict[int, dict[str, Any]] = {}

    def restored(s3_latest: int | None) -> tuple[Any, bool]:
        fresh_model, fresh = make_state(rank, seed=2)
        with TieredCheckpointProcess(uri, tier) as tiered:
            got = tiered.restore_latest(fresh, s3_latest)
        if got is None:
            reader = S3StorageReader(f"{uri}/step-{s3_latest}", **s3)
            dcp.load(fresh, storage_reader=reader)
            where = (s3_latest, "s3")
        else:
            where = (got.step, got.tier)
        return where, same_state(snapshot(fresh_model, fresh, rank), expected[where[0]])

    with reporting_rank(rank, world_size, port, out_dir) as report:
        with TieredCheckpointProcess(uri, tier) as tiered:
            for step in (1, 2, 3, 4):
                train_step(model, state, step)
                state[f"rank{rank}"].add_(step)
                writer = None
                if tier.to_s3(step):
                    writer = S3StorageWriter(f"{uri}/step-{step}", **s3)
                save = tiered.async_save(state, step, storage_writer=writer)
                expected[step] = snapshot(model, state, rank)
                save.replicated.result(timeout=120)
                report[f"done-{step}"] = save.result(timeout=120) is not None
            # the ranks disagree on whether step 5 uploads: refused on every rank,
            # before a slot is emptied
            writer = S3StorageWriter(f"{uri}/step-5", **s3) if rank == 0 else None
            try:
                tiered.async_save(state, 5, storage_writer=writer)
                report["disagreement"] = "saved"
            except ConfigError as exc:
                report["disagreement"] = str(exc)
            report["held"] = tiered.held_steps()
            report["replicated"] = tiered.replicated_steps()
        report["restarted"] = restored(s3_latest=4)  # memory's 4 (as new as S3's)
        if rank == 1:
            shutil.rmtree(tier.root)  # node 1 lost: rebuilt from node 0's replica
        dist.barrier()
        report["node_lost"] = restored(s3_latest=4)
        shutil.rmtree(tier.root, ignore_errors=True)  # every node lost: S3 alone
        dist.barrier()
        report["all_lost"] = restored(s3_latest=4)
        dist.barrier()
