"""The memory tier restores a job whose world size changed: the old job's copies on the
node, every rank's together, are its step's checkpoint, loaded resharded as from S3;
damage found in one walks back, a node missing one falls back to S3, and the new
layout frees the old one's copies at its first save. A job of the same world size
sharded another way is never loaded in part from its own copies; with no S3 step, no
rank loads a byte until every rank found its copies intact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _reshard_tier_worker as worker
import torch
from _dist_worker import run_ranks

from s3ckpt import CheckpointManager, MemoryTier
from s3ckpt.background import held
from s3ckpt.tier.copies import node_copies


def run(
    main, world: int, s3_options, uri, tmp_path: Path, root: Path, *args: Any
) -> list[dict[str, Any]]:
    out = tmp_path / f"{main.__name__}-{world}"
    out.mkdir(exist_ok=True)
    run_ranks(main, world, s3_options, uri, str(out), str(root), *args, timeout=300)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def assert_state(got: dict[str, Any], step: int) -> None:
    want = worker.full_state(step)
    for name in ("w", "b", "emb"):
        assert torch.equal(got[name], want[name]), name
    assert got["extra"] == want["extra"]


def restore_alone(uri, s3_options, root: Path) -> tuple[tuple[int | None, str], dict]:
    """One process (world size 1) restores the plain, unsharded state."""
    state = worker.zeroed(0)
    tier = MemoryTier(keep=2, s3_every=2, root=root)
    with CheckpointManager(uri, memory_tier=tier, **s3_options) as manager:
        step = manager.load_latest(state)
        return (step, manager.last_restore.tier), state


def copies_of(root: Path, step: int, rank: int) -> list[Path]:
    return [
        c.folder for c in node_copies(root)
        if c.held.step == step and c.held.rank == rank and c.held.world == 2
    ]  # fmt: skip


def test_a_job_with_another_world_size_restores_from_the_nodes_copies(
    local_s3, s3_prefix, s3_options, tmp_path, shm_root
):
    saved = run(worker.save_main, 2, s3_options, s3_prefix, tmp_path, shm_root)
    assert all(r["held"] == [2, 3] and r["s3"] == [2] for r in saved)

    # three ranks (each a third of every shard, cut across the old halves)
    for report in run(worker.restore_main, 3, s3_options, s3_prefix, tmp_path, shm_root):
        assert (report["step"], report["tier"]) == (3, "memory")
        assert_state(report["state"], 3)

    # one process, plain tensors
    where, state = restore_alone(s3_prefix, s3_options, shm_root)
    assert where == (3, "memory")
    assert_state(state, 3)


def damage(root: Path, step: int, rank: int) -> None:
    """Flip a bit in every region of ``rank``'s copy of ``step``: a load reads some."""
    (folder,) = copies_of(root, step, rank)
    record = held.read(folder)
    assert record is not None
    for region in record.regions:
        if region.nbytes:
            with open(folder / f"segment-{region.segment}", "r+b") as f:
                f.seek(region.offset + region.nbytes // 2)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0x10]))


def test_resharding_checks_what_it_reads_walks_back_and_falls_back(
    local_s3, s3_prefix, s3_options, tmp_path, shm_root
):
    run(worker.save_main, 2, s3_options, s3_prefix, tmp_path, shm_root)
    damage(shm_root, 3, 1)
    where, state = restore_alone(s3_prefix, s3_options, shm_root)
    assert where == (2, "memory")  # loaded over the damaged step's bytes
    assert_state(state, 2)

    # rank 1's copy of step 2 gone from the node: no step is whole there, S3's 2 is
    (folder,) = copies_of(shm_root, 2, 1)
    held.invalidate(folder)
    where, state = restore_alone(s3_prefix, s3_options, shm_root)
    assert where == (2, "s3")
    assert_state(state, 2)


def test_the_new_layout_frees_the_old_ones_copies_at_its_first_save(
    local_s3, s3_prefix, s3_options, tmp_path, shm_root
):
    run(worker.save_main, 2, s3_options, s3_prefix, tmp_path, shm_root)
    tier = MemoryTier(keep=2, s3_every=2, root=shm_root)
    state = worker.zeroed(0)
    with CheckpointManager(s3_prefix, memory_tier=tier, **s3_options) as manager:
        assert manager.load_latest(state) == 3
        assert {(c.held.world, c.held.rank) for c in node_copies(shm_root)} == {
            (2, 0), (2, 1)
        }  # fmt: skip
        state["w"].add_(1)
        manager.save(4, state)
        manager.wait()
        assert manager.held_steps() == [4]
    held_now = [(c.held.world, c.held.rank, c.held.step) for c in node_copies(shm_root)]
    assert held_now == [(1, 0, 4)]
    (run_folder,) = shm_root.glob("run-*")
    assert sorted(p.name for p in run_folder.glob("rank-*")) == ["rank-00000"]
    where, loaded = restore_alone(s3_prefix, s3_options, shm_root)
    assert where == (4, "memory")
    assert torch.equal(loaded["w"], state["w"])


def test_with_no_s3_step_every_old_copy_is_checked_before_a_byte_is_loaded(
    local_s3, s3_prefix, s3_options, tmp_path, shm_root
):
    run(worker.save_main, 2, s3_options, s3_prefix, tmp_path, shm_root, 1000)  # memory only
    damage(shm_root, 3, 1)
    state = worker.zeroed(0)
    tier = MemoryTier(keep=2, s3_every=1000, root=shm_root)
    with CheckpointManager(s3_prefix, memory_tier=tier, **s3_options) as manager:
        assert manager.steps() == []
        assert manager.load_latest(state) == 2
        assert manager.last_restore.tier == "memory"
    assert_state(state, 2)
    # both steps damaged: nothing to load, and the state is left as it was
    damage(shm_root, 2, 0)
    untouched = worker.zeroed(0)
    with CheckpointManager(s3_prefix, memory_tier=tier, **s3_options) as manager:
        assert manager.load_latest(untouched) is None
    for name in ("w", "b", "emb"):
        assert not untouched[name].any(), name


def test_the_same_world_sharded_another_way_is_not_loaded_in_part(
    local_s3, s3_prefix, s3_options, tmp_path, shm_root
):
    run(worker.save_main, 2, s3_options, s3_prefix, tmp_path, shm_root)
    # w by columns now: each rank's own copy holds half of the rows it needs
    for report in run(worker.restore_main, 2, s3_options, s3_prefix, tmp_path, shm_root, 1):
        assert (report["step"], report["tier"]) == (2, "s3")
        assert_state(report["state"], 2)


def test_with_no_s3_step_a_damaged_copy_on_one_rank_leaves_every_rank_untouched(
    local_s3, s3_prefix, s3_options, tmp_path, shm_root
):
    run(worker.save_main, 2, s3_options, s3_prefix, tmp_path, shm_root, 1000)  # memory only
    damage(shm_root, 3, 1)
    damage(shm_root, 2, 1)  # rank 0's copies intact, rank 1's not
    reports = run(worker.restore_main, 2, s3_options, s3_prefix, tmp_path, shm_root, 0, 1000)
    for report in reports:
        assert report["step"] is None and report["tier"] is None
        for name in ("w", "b", "emb"):
            assert not report["state"][name].any(), name
