"""The memory tier of CheckpointManager: copies held in shared memory (a folder of
/dev/shm per test, standing for a node's), S3 every n-th step, restores that agree,
verify, walk back and fall back to S3; faults on one and two gloo ranks."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import _manager_worker as worker
import pytest
import torch

from s3ckpt import CheckpointError, CheckpointManager, ConfigError, MemoryTier, MemoryTierError
from s3ckpt.background import held
from s3ckpt.tier import restore as restore_module
from s3ckpt.tier.copies import node_copies


def trained(steps: range, seed: int = 1) -> tuple[torch.nn.Module, dict[str, Any]]:
    model, state = worker.make_state(0, seed=seed)
    for step in steps:
        worker.train_step(model, state, step)
    return model, state


def saving_run(uri, s3_options, tier, steps) -> dict[int, dict[str, Any]]:
    """Save each of ``steps`` after training it; the snapshot at each step."""
    model, state = worker.make_state(0, seed=1)
    snapshots = {}
    with CheckpointManager(uri, memory_tier=tier, **s3_options) as manager:
        for step in steps:
            worker.train_step(model, state, step)
            state["rank0"].add_(step)
            assert manager.save(step, state) is True
            manager.wait()
            snapshots[step] = worker.snapshot(model, state, 0)
    return snapshots


def restore(uri, s3_options, tier) -> tuple[int | None, Any, dict[str, Any]]:
    model, state = worker.make_state(0, seed=2)
    with CheckpointManager(uri, memory_tier=tier, **s3_options) as manager:
        step = manager.load_latest(state)
        return step, manager.last_restore, worker.snapshot(model, state, 0)


def assert_same(loaded: dict[str, Any], expected: dict[str, Any]) -> None:
    for key, value in expected["params"].items():
        assert torch.equal(loaded["params"][key], value), key
    for got, want in zip(loaded["exp_avg"], expected["exp_avg"], strict=True):
        assert torch.equal(got, want)
    assert torch.equal(loaded["own"], expected["own"])


def on_two_nodes(main, s3_options, uri, tmp_path, shm_root) -> list[dict[str, Any]]:
    """Run ``main`` on two gloo ranks, each with a folder of ``shm_root`` as its node's
    shared memory; their reports."""
    roots = [str(shm_root / "node0"), str(shm_root / "node1")]
    worker.run_ranks(main, 2, s3_options, uri, str(tmp_path), roots, timeout=300)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


def slot_of(root: Path, step: int) -> Path:
    (copy,) = [c for c in node_copies(root) if c.held.step == step]
    return copy.folder


def test_saves_hold_every_step_and_upload_every_nth(s3_prefix, s3_options, shm_root):
    tier = MemoryTier(keep=2, s3_every=2, root=shm_root)
    model, state = worker.make_state(0, seed=1)
    with CheckpointManager(s3_prefix, memory_tier=tier, **s3_options) as manager:
        for step in (1, 2, 3):
            worker.train_step(model, state, step)
            manager.save(step, state)
            metrics = manager.wait()
            assert metrics is not None and metrics.held_s is not None and metrics.held_s >= 0
            assert metrics.to_s3 is (step == 2)
            assert metrics.bytes > 0
        assert manager.steps() == [2]  # only the step s3_every divides went to S3
        assert manager.held_steps() == [2, 3]  # keep=2: the two newest
        staging = manager._saves.process.staging_bytes
    # the held copies are the staging memory: two slots, nothing else in shared memory
    on_disk = sum(p.stat().st_size for p in shm_root.rglob("segment-*"))
    assert on_disk == staging
    assert {c.held.step for c in node_copies(shm_root)} == {2, 3}


def test_a_restarted_process_restores_the_newest_step_from_memory_bit_exact(
    s3_prefix, s3_options, shm_root
):
    tier = MemoryTier(keep=2, s3_every=2, root=shm_root)
    snapshots = saving_run(s3_prefix, s3_options, tier, range(1, 6))
    step, restored, loaded = restore(s3_prefix, s3_options, tier)
    assert step == 5 and restored.tier == "memory"  # newer than S3's step 4
    assert_same(loaded, snapshots[5])


def test_s3_wins_when_it_is_newer_than_memory(s3_prefix, s3_options, shm_root):
    tier = MemoryTier(keep=2, s3_every=2, root=shm_root)
    saving_run(s3_prefix, s3_options, tier, range(1, 5))  # memory 3, 4; S3 2, 4
    # a second node's run went on to step 6 on S3 (this node's memory stopped at 4)
    model, state = trained(range(1, 7))
    with CheckpointManager(s3_prefix, **s3_options) as other:
        other.save(6, state)
        other.wait()
    step, restored, loaded = restore(s3_prefix, s3_options, tier)
    assert step == 6 and restored.tier == "s3"
    assert_same(loaded, worker.snapshot(model, state, 0))


def flip_a_bit(root: Path, step: int, at: int = 4096 + 17) -> None:
    with open(slot_of(root, step) / "segment-0", "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_damaged_copy_is_not_used_the_restore_walks_back(s3_prefix, s3_options, shm_root):
    """With nothing in S3 the copy is checked before it is loaded, so a restore that
    finds nothing intact would leave the state untouched."""
    tier = MemoryTier(keep=2, s3_every=10, root=shm_root)
    snapshots = saving_run(s3_prefix, s3_options, tier, range(1, 4))  # S3: nothing
    flip_a_bit(shm_root, 3)
    step, restored, loaded = restore(s3_prefix, s3_options, tier)
    assert step == 2 and restored.tier == "memory"
    assert_same(loaded, snapshots[2])


def test_a_copy_rewritten_after_its_check_is_caught_as_it_lands(
    s3_prefix, s3_options, shm_root, monkeypatch
):
    """With nothing in S3, copies are checked whole before a byte is loaded, and again
    as they land: a copy rewritten in between (a live run's slot, read by another job)
    is not loaded as if intact; the restore walks back."""
    tier = MemoryTier(keep=2, s3_every=10, root=shm_root)
    snapshots = saving_run(s3_prefix, s3_options, tier, range(1, 4))  # S3: nothing
    checked_then_applied = restore_module.apply_held

    def rewritten_in_between(state_dict, copies, version, *args, **kwargs):
        if version[0] == 3:
            flip_a_bit(shm_root, 3)
        return checked_then_applied(state_dict, copies, version, *args, **kwargs)

    monkeypatch.setattr(restore_module, "apply_held", rewritten_in_between)
    step, restored, loaded = restore(s3_prefix, s3_options, tier)
    assert step == 2 and restored.tier == "memory"
    assert_same(loaded, snapshots[2])


@pytest.mark.parametrize("region", ["first", "last"])
def test_damage_found_while_loading_is_loaded_over(s3_prefix, s3_options, shm_root, region):
    """With a committed S3 step behind, copies are checked as they are read into the
    model: the damaged step's bytes may land, and the older step loaded over them must
    leave the model bit-exact at that step, never mixed."""
    tier = MemoryTier(keep=2, s3_every=2, root=shm_root)
    snapshots = saving_run(s3_prefix, s3_options, tier, [2, 3, 5])  # S3: 2; memory: 3, 5
    copy = next(c for c in node_copies(shm_root) if c.held.step == 5).held
    last = max(copy.regions, key=lambda r: (r.segment == 0, r.offset))
    flip_a_bit(shm_root, 5, at=4096 + 17 if region == "first" else last.offset + last.nbytes - 1)
    step, restored, loaded = restore(s3_prefix, s3_options, tier)
    assert step == 3 and restored.tier == "memory"
    assert_same(loaded, snapshots[3])


def test_damage_in_the_only_memory_step_falls_back_to_s3(s3_prefix, s3_options, shm_root):
    tier = MemoryTier(keep=2, s3_every=1, root=shm_root)
    snapshots = saving_run(s3_prefix, s3_options, tier, range(1, 4))  # S3 and memory: 3
    flip_a_bit(shm_root, 3)
    step, restored, loaded = restore(s3_prefix, s3_options, tier)
    assert step == 3 and restored.tier == "s3"
    assert_same(loaded, snapshots[3])


def test_a_copy_without_its_descriptor_is_not_held(s3_prefix, s3_options, shm_root):
    """A save killed between its copy and its record: the slot holds nothing."""
    tier = MemoryTier(keep=2, s3_every=2, root=shm_root)
    snapshots = saving_run(s3_prefix, s3_options, tier, range(1, 4))  # S3: 2; memory 2, 3
    (slot_of(shm_root, 3) / held.DESCRIPTOR).unlink()
    step, restored, loaded = restore(s3_prefix, s3_options, tier)
    assert step == 2 and restored.tier == "memory"  # as new as S3's, and local
    assert_same(loaded, snapshots[2])


def test_a_checkpoint_process_killed_before_the_record_leaves_the_older_step(
    s3_prefix, s3_options, shm_root, monkeypatch
):
    """SIGKILL the checkpoint process while it checksums step 2's copy: step 2 is not
    held, step 1 is, and the next save starts a fresh process."""
    tier = MemoryTier(keep=2, s3_every=100, root=shm_root)
    model, state = worker.make_state(0, seed=1)
    big = {"app": state["app"], "rank0": state["rank0"], "big": torch.randn(64 << 20)}
    with CheckpointManager(s3_prefix, memory_tier=tier, **s3_options) as manager:
        manager.save(1, big)
        manager.wait()
        expected = worker.snapshot(model, big, 0)
        worker.train_step(model, big, 2)
        process = manager._saves.process
        os.kill(process.pid, signal.SIGSTOP)  # staged, then killed before it can record
        manager.save(2, big)
        os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(Exception, match="killed by signal 9"):
            manager.wait()
        assert manager.held_steps() == [1]
        manager.save(3, big)  # a fresh process
        manager.wait()
        assert manager.held_steps() == [1, 3]
    (slot_of(shm_root, 3) / held.DESCRIPTOR).unlink()
    fresh_model, fresh = worker.make_state(0, seed=2)
    fresh_big = {"app": fresh["app"], "rank0": fresh["rank0"], "big": torch.zeros(64 << 20)}
    with CheckpointManager(s3_prefix, memory_tier=tier, **s3_options) as restarted:
        assert restarted.load_latest(fresh_big) == 1
    assert_same(worker.snapshot(fresh_model, fresh_big, 0), expected)


def test_rolling_back_forgets_the_abandoned_steps_in_memory(s3_prefix, s3_options, shm_root):
    tier = MemoryTier(keep=3, s3_every=1, root=shm_root)
    saving_run(s3_prefix, s3_options, tier, range(1, 4))
    model, state = worker.make_state(0, seed=2)
    with CheckpointManager(s3_prefix, memory_tier=tier, **s3_options) as manager:
        manager.load(1, state)  # roll back: steps 2 and 3 are the abandoned run's
        assert manager.held_steps() == [1]
        worker.train_step(model, state, 102)  # the new run's step 2 differs from the old
        manager.save(2, state)
        manager.wait()
        expected = worker.snapshot(model, state, 0)
        assert manager.held_steps() == [1, 2] and manager.steps() == [1, 2]
    step, restored, loaded = restore(s3_prefix, s3_options, tier)
    assert step == 2 and restored.tier == "memory"
    assert_same(loaded, expected)


def test_a_state_that_no_longer_matches_falls_back_to_s3(s3_prefix, s3_options, shm_root):
    tier = MemoryTier(keep=2, s3_every=2, root=shm_root)
    snapshots = saving_run(s3_prefix, s3_options, tier, range(1, 4))  # S3 2, memory 2, 3
    _, state = worker.make_state(0, seed=2)
    state["extra"] = torch.zeros(3)  # a key no copy has: nothing from memory is applied
    with CheckpointManager(s3_prefix, memory_tier=tier, **s3_options) as manager:
        # memory's step 3 does not fit (a warning), so S3's step 2 is loaded; it lacks the
        # key too: DCP's own error, named in the manager's CheckpointError (chained)
        with pytest.raises(CheckpointError, match="Missing key in checkpoint state_dict: extra"):
            manager.load_latest(state)
        assert manager.last_restore is None
    del state["extra"]
    step, restored, loaded = restore(s3_prefix, s3_options, tier)
    assert step == 3 and restored.tier == "memory"
    assert_same(loaded, snapshots[3])


def test_options_are_checked_at_construction(s3_prefix, s3_options, shm_root):
    with pytest.raises(ConfigError, match="keep"):
        MemoryTier(keep=0)
    with pytest.raises(ConfigError, match="s3_every"):
        MemoryTier(s3_every=-1)
    with pytest.raises(ConfigError, match="process"):
        CheckpointManager(s3_prefix, memory_tier=MemoryTier(root=shm_root),
                          async_mode="thread", **s3_options)  # fmt: skip
    too_big = MemoryTier(root=shm_root, max_bytes=1 << 50, local_ranks=1)
    with pytest.raises(MemoryTierError, match=r"needs \d+ bytes at"):
        CheckpointManager(s3_prefix, memory_tier=too_big, **s3_options)


def test_a_state_over_max_bytes_fails_its_save_before_a_byte_is_copied(
    s3_prefix, s3_options, shm_root
):
    tier = MemoryTier(keep=2, s3_every=100, root=shm_root)
    snapshots = saving_run(s3_prefix, s3_options, tier, (1, 2))
    small = MemoryTier(keep=2, s3_every=100, root=shm_root, max_bytes=1024, local_ranks=1)
    _, state = worker.make_state(0, seed=3)
    with CheckpointManager(s3_prefix, memory_tier=small, **s3_options) as manager:
        with pytest.raises(
            MemoryTierError, match=r"more than the memory tier's max_bytes \(1024\)"
        ):
            manager.save(3, state)
        assert manager._saves.process.staging_bytes == 0  # no segment made for it
        assert manager.held_steps() == [2]  # the newest copy kept; nothing of 3 written
    step, restored, loaded = restore(s3_prefix, s3_options, tier)
    assert (step, restored.tier) == (2, "memory")
    assert_same(loaded, snapshots[2])


def test_two_ranks_on_two_simulated_nodes_survive_each_fault(
    local_s3, s3_prefix, s3_options, tmp_path, shm_root
):
    reports = on_two_nodes(worker.memory_tier_main, s3_options, s3_prefix, tmp_path, shm_root)
    for report in reports:
        assert report["held"] == [3, 4] and report["s3"] == [2, 4]
        assert report["restarted"] == ((4, "memory"), True)
        assert report["disagreement"].startswith(
            "ConfigError: step-0000000005: the ranks did not start the same save (rank 0: "
            "step 5, to S3, rank 1: step 5, memory only)"
        )
        assert report["one_copy_deleted"] == ((4, "memory"), True)
        assert report["node_lost"] == ((4, "s3"), True)
        assert report["killed_save"] == "CheckpointProcessError"
        assert report["killed_before_commit"] == ((5, "memory"), True)
    assert reports[0]["held_after_kill"] == [5, 6]  # rank 0 held 6; rank 1 never did
    assert reports[1]["held_after_kill"] == [5]


def test_a_step_saved_again_after_a_rollback_is_never_assembled_from_two_timelines(
    local_s3, s3_prefix, s3_options, tmp_path, shm_root
):
    """Copies carry their lineage: node 0 holds rank 0's step 3 from the first timeline
    and rank 1's from the second (saved after a restore from S3's step 1), every CRC
    intact; the restore takes neither and loads S3's step 3, bit-exact on both ranks
    (assembled from both, rank 0's model would be the first timeline's)."""
    reports = on_two_nodes(worker.lineage_main, s3_options, s3_prefix, tmp_path, shm_root)
    for report in reports:
        assert report["swapped"] == (1, "s3")  # neither node holds the swapped rank's copies
        assert report["together"] == ((3, "s3"), True)


def test_the_cli_lists_verifies_and_removes_what_a_node_holds(s3_prefix, s3_options, shm_root, cli):
    tier = MemoryTier(keep=2, s3_every=2, root=shm_root)
    saving_run(s3_prefix, s3_options, tier, range(1, 4))
    listed = cli("memory", "--root", str(shm_root), "--json")
    assert listed.code == 0
    assert [(c["run"], c["step"], c["rank"], c["world"]) for c in listed.json()] == [
        (s3_prefix, 3, 0, 1),
        (s3_prefix, 2, 0, 1),
    ]
    table = cli("memory", "--root", str(shm_root), "--verify")
    assert table.code == 0 and table.out.count("intact") == 2 and "STEP" in table.out
    with open(slot_of(shm_root, 2) / "segment-0", "r+b") as f:
        f.write(b"\xff" * 8)
    damaged = cli("memory", "--root", str(shm_root), "--verify")
    assert damaged.code == 1 and "does not match its CRC32C" in damaged.err
    removed = cli("memory", "--root", str(shm_root), "--rm", s3_prefix)
    assert removed.code == 0 and "freed" in removed.out
    empty = cli("memory", "--root", str(shm_root))
    assert empty.code == 0 and "no copies held" in empty.err


def test_replicas_on_another_node_rebuild_a_lost_node_from_memory(
    local_s3, s3_prefix, s3_options, tmp_path, shm_root
):
    reports = on_two_nodes(worker.replicated_tier_main, s3_options, s3_prefix, tmp_path, shm_root)
    for report in reports:
        assert report["held"] == [3, 4] and report["replicated"] == [3, 4]
        metrics = report["metrics"]
        assert metrics.to_s3 and 0 <= metrics.held_s <= metrics.replicated_s <= metrics.upload_s
        assert report["node_lost"] == ((5, "memory"), True)  # rank 1's from rank 0's replica
        assert report["killed_save"] == "CheckpointProcessError"
        assert report["killed_during_replication"] == ((6, "memory"), True)
        # a copy received into a slot the running manager stages into stays readable there
        assert report["fetched_in_place"] is True
        assert report["after_fetch_in_place"] == ((11, "memory"), True)
        assert report["damaged_replica"] == ((10, "memory"), True)
    # rank 1 received 5 straight into its model (S3 held step 4 to fall back on): it holds
    # no copy of 5 until its next save; node 0's replica still does
    assert reports[0]["held_after_restore"][0] == []
    # 7 is held by rank 0 alone; rank 1 emptied the slot of 5 for it
    assert reports[0]["held_after_kill"] == [6]
