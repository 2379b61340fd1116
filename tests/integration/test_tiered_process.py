"""TieredCheckpointProcess: the memory tier for scripts that call dcp.async_save and name
their own S3 checkpoints. Saves held (and every n-th uploaded from the same memory), a
restarted script restoring from memory, S3 when it is newer, damage walked back over,
bad input; two gloo ranks on two simulated nodes: replicas rebuild a lost node."""

from __future__ import annotations

from typing import Any

import _manager_worker as worker
import _tiered_worker
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from s3ckpt import (
    BucketNotFoundError,
    CheckpointProcessError,
    ConfigError,
    MemoryTier,
    S3StorageReader,
    S3StorageWriter,
    TieredCheckpointProcess,
)
from s3ckpt.tier.copies import node_copies


def run_script(uri, s3_options, tier, steps) -> tuple[dict[int, Any], list[Any], list[int]]:
    """A script saving each of ``steps`` through the tier, a writer for the steps the tier
    sends to S3: the snapshot at each step, each save's outcome, the held steps."""
    model, state = worker.make_state(0, seed=1)
    snapshots, outcomes = {}, []
    with TieredCheckpointProcess(uri, tier) as tiered:
        for step in steps:
            worker.train_step(model, state, step)
            state["rank0"].add_(step)
            writer = None
            if tier.to_s3(step):
                writer = S3StorageWriter(f"{uri}/step-{step}", **s3_options)
            save = tiered.async_save(state, step, storage_writer=writer)
            snapshots[step] = worker.snapshot(model, state, 0)
            save.held.result(timeout=60)
            save.replicated.result(timeout=60)  # nothing to replicate to: as held
            outcomes.append((save.step, save.to_s3, save.result(timeout=60)))
        held = tiered.held_steps()
    return snapshots, outcomes, held


def restore(uri, tier, s3_latest, planner=None) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    model, state = worker.make_state(0, seed=2)
    before = worker.snapshot(model, state, 0)
    with TieredCheckpointProcess(uri, tier) as tiered:
        restored = tiered.restore_latest(state, s3_latest, planner=planner)
    return restored, worker.snapshot(model, state, 0), before


def test_saves_are_held_and_every_nth_uploaded_from_the_same_memory(
    s3_prefix, s3_options, shm_root
):
    tier = MemoryTier(keep=2, s3_every=2, root=shm_root)
    snapshots, outcomes, held = run_script(s3_prefix, s3_options, tier, (1, 2, 3))
    assert [(step, to_s3) for step, to_s3, _ in outcomes] == [(1, False), (2, True), (3, False)]
    assert outcomes[0][2] is None and outcomes[2][2] is None  # held only: no DCP metadata
    assert outcomes[1][2] is not None  # uploaded: DCP's Metadata
    assert held == [2, 3]
    assert {c.held.step for c in node_copies(shm_root)} == {2, 3}
    # what went to S3 loads with a plain dcp.load
    model, state = worker.make_state(0, seed=2)
    reader = S3StorageReader(f"{s3_prefix}/step-2", **s3_options)
    dcp.load(state, storage_reader=reader)
    assert worker.same_state(worker.snapshot(model, state, 0), snapshots[2])


def test_a_restarted_script_restores_the_newest_step_from_memory_bit_exact(
    s3_prefix, s3_options, shm_root
):
    tier = MemoryTier(keep=2, s3_every=2, root=shm_root)
    snapshots, _, _ = run_script(s3_prefix, s3_options, tier, range(1, 6))

    class Counting(DefaultLoadPlanner):
        calls = 0

        def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
            Counting.calls += 1
            super().set_up_planner(*args, **kwargs)

    restored, loaded, _ = restore(s3_prefix, tier, s3_latest=4, planner=Counting())
    assert restored is not None and (restored.step, restored.tier) == (5, "memory")
    assert worker.same_state(loaded, snapshots[5])
    assert Counting.calls == 1  # the caller's planner is the load's


def test_s3_wins_when_it_is_newer_and_nothing_is_touched(s3_prefix, s3_options, shm_root):
    tier = MemoryTier(keep=2, s3_every=2, root=shm_root)
    run_script(s3_prefix, s3_options, tier, range(1, 5))  # memory 3, 4
    restored, loaded, before = restore(s3_prefix, tier, s3_latest=6)
    assert restored is None
    assert worker.same_state(loaded, before)
    # the caller goes on from S3's step 6: what memory holds above it would be abandoned
    # steps, below it is kept
    assert {c.held.step for c in node_copies(shm_root)} == {3, 4}


def test_nothing_held_leaves_the_state_untouched(s3_prefix, shm_root):
    tier = MemoryTier(keep=2, root=shm_root)
    restored, loaded, before = restore(s3_prefix, tier, s3_latest=None)
    assert restored is None
    assert worker.same_state(loaded, before)


def test_a_damaged_copy_is_walked_back_over(s3_prefix, s3_options, shm_root):
    tier = MemoryTier(keep=2, s3_every=100, root=shm_root)
    snapshots, _, _ = run_script(s3_prefix, s3_options, tier, (1, 2))
    (newest,) = [c.folder for c in node_copies(shm_root) if c.held.step == 2]
    with open(newest / "segment-0", "r+b") as f:
        f.seek(4096 + 17)
        byte = f.read(1)[0]
        f.seek(4096 + 17)
        f.write(bytes([byte ^ 1]))
    restored, loaded, _ = restore(s3_prefix, tier, s3_latest=None)
    assert restored is not None and restored.step == 1
    assert worker.same_state(loaded, snapshots[1])


def test_a_failed_upload_fails_its_save_and_keeps_the_held_copy(s3_options, shm_root):
    tier = MemoryTier(keep=2, root=shm_root)
    _model, state = worker.make_state(0, seed=1)
    with TieredCheckpointProcess("s3://no-such-bucket/run", tier) as tiered:
        writer = S3StorageWriter("s3://no-such-bucket/run/step-1", **s3_options)
        save = tiered.async_save(state, 1, storage_writer=writer)
        with pytest.raises(BucketNotFoundError):
            save.result(timeout=60)
        assert save.held.exception(timeout=60) is None
        assert tiered.held_steps() == [1]
        # the next save goes on (held only, so it returns no metadata)
        assert tiered.async_save(state, 2).result(timeout=60) is None


def test_bad_input_is_refused_with_one_clear_error(s3_prefix, shm_root):
    with pytest.raises(ConfigError, match="MemoryTier"):
        TieredCheckpointProcess(s3_prefix, {"keep": 2})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="run"):
        TieredCheckpointProcess("", MemoryTier(root=shm_root))
    _, state = worker.make_state(0, seed=1)
    tiered = TieredCheckpointProcess(s3_prefix, MemoryTier(root=shm_root))
    with tiered:
        for step in (-1, 1.5, True):
            with pytest.raises(ConfigError, match="step"):
                tiered.async_save(state, step)  # type: ignore[arg-type]
    with pytest.raises(CheckpointProcessError, match="closed"):
        tiered.async_save(state, 1)
    assert tiered.pid is None


def test_two_nodes_replicas_rebuild_a_lost_node_and_s3_the_rest(
    local_s3, s3_prefix, s3_options, tmp_path, shm_root
):
    roots = [str(shm_root / "node0"), str(shm_root / "node1")]
    worker.run_ranks(
        _tiered_worker.tiered_process_main, 2, s3_options, s3_prefix, str(tmp_path), roots,
        timeout=300,
    )  # fmt: skip
    reports = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for report in reports:
        assert [report[f"done-{s}"] for s in (1, 2, 3, 4)] == [False, True, False, True]
        assert (
            "did not start the same save (rank 0: step 5, uploaded, rank 1: step 5, held"
            in (report["disagreement"])
        )
        assert report["held"] == [3, 4] and report["replicated"] == [3, 4]
        assert report["restarted"] == ((4, "memory"), True)
        assert report["node_lost"] == ((4, "memory"), True)  # rank 1's from rank 0's replica
        assert report["all_lost"] == ((4, "s3"), True)
