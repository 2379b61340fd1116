"""The memory tier's rules without processes or S3: replica layout, slot rotation, what
counts as held, which step a restore may choose and where missing copies come from."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from s3ckpt.background import held
from s3ckpt.errors import ConfigError, MemoryTierError
from s3ckpt.tier.copies import Holdings, LocalCopies, node_copies
from s3ckpt.tier.options import MemoryTier
from s3ckpt.tier.peers import replica_sources, replica_targets
from s3ckpt.tier.restore import _fetch_plan, _rebuildable

RUN = "s3://bucket/run"


def record(
    step: int,
    rank: int = 0,
    world: int = 1,
    run: str = RUN,
    created: float = 0.0,
    lineage: str = "a",
):
    return held.HeldRecord(
        step=step, rank=rank, world=world, run=run, segments=(4096,),
        regions=(held.HeldRegion(0, 0, 8, 1234),), state_crc32c=5, nbytes=8,
        created=created or time.time(), lineage=lineage,
    )  # fmt: skip


def test_replicas_go_to_other_nodes_evenly():
    nodes = ["a", "a", "b", "b", "c", "c"]
    assert replica_targets(nodes, 1) == [[2], [3], [4], [5], [0], [1]]
    assert replica_targets(nodes, 2) == [[2, 4], [3, 5], [4, 0], [5, 1], [0, 2], [1, 3]]
    assert replica_sources(replica_targets(nodes, 1), 0) == [4]
    assert replica_targets(["a", "a"], 1) == [[], []]  # one node: nothing to replicate to
    assert replica_targets(["a", "b"], 3) == [[1], [0]]  # at most the other nodes
    assert replica_targets(["a", "b", "b", "b"], 1) == [[1], [0], [0], [0]]  # uneven nodes


def test_options_are_refused_at_construction():
    with pytest.raises(ConfigError, match="keep"):
        MemoryTier(keep=0)
    with pytest.raises(ConfigError, match="replicas"):
        MemoryTier(replicas=-1)
    with pytest.raises(ConfigError, match="keep=1 with replicas"):
        MemoryTier(keep=1)
    assert MemoryTier(keep=1, replicas=0).keep == 1
    assert MemoryTier(s3_every=100).to_s3(300) and not MemoryTier(s3_every=100).to_s3(250)


def test_the_root_is_checked_for_room(tmp_path: Path):
    tier = MemoryTier(root=tmp_path, max_bytes=1 << 50, local_ranks=2)
    with pytest.raises(MemoryTierError, match=r"needs \d+ bytes .* \(2 copies .* 2 local rank"):
        LocalCopies(tier, RUN, 0, 1)
    LocalCopies(MemoryTier(root=tmp_path, max_bytes=1 << 20), RUN, 0, 1)  # room enough


def test_the_root_variable_names_the_default_root(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("S3CKPT_MEMORY_ROOT", str(tmp_path / "tier"))
    assert MemoryTier().root == tmp_path / "tier"


def test_a_save_never_overwrites_the_newest_copy(tmp_path: Path):
    copies = LocalCopies(MemoryTier(root=tmp_path, keep=2), RUN, 0, 1)
    assert copies.next_slot() == 0
    held.write(copies.slots[0], record(10, created=1.0), b"state")
    assert copies.next_slot() == 1
    held.write(copies.slots[1], record(20, created=2.0), b"state")
    assert copies.next_slot() == 0  # the older copy
    assert [h.held.step for h in copies.held()] == [20, 10]
    copies.invalidate(0)
    assert [h.held.step for h in copies.held()] == [20] and copies.next_slot() == 0


def test_only_this_run_rank_and_world_count(tmp_path: Path):
    copies = LocalCopies(MemoryTier(root=tmp_path, keep=3), RUN, 0, 2)
    held.write(copies.slots[0], record(1, rank=0, world=2), b"s")
    held.write(copies.slots[1], record(2, rank=0, world=4), b"s")  # another world size
    held.write(copies.slots[2], record(3, rank=0, world=2, run="s3://bucket/other"), b"s")
    assert [h.held.step for h in copies.held()] == [1]
    (copies.slots[0] / held.DESCRIPTOR).write_text("{not json")
    assert copies.held() == []  # an unreadable descriptor holds nothing


def test_replicas_are_kept_apart_and_listed_as_such(tmp_path: Path):
    copies = LocalCopies(MemoryTier(root=tmp_path), RUN, 0, 2, sources=[1])
    held.write(copies.slots[0], record(5, rank=0, world=2), b"s")
    held.write(copies.next_replica_folder(1), record(5, rank=1, world=2), b"s")
    assert copies.holdings() == Holdings([(5, "a")], {1: [(5, "a")]})
    assert copies.replica_of(1, (5, "a")) is not None and copies.replica_of(1, (4, "a")) is None
    assert copies.replica_of(1, (5, "b")) is None  # another lineage's step 5
    assert copies.own_copy((5, "a")) is not None and copies.own_copy((5, "b")) is None
    listed = [(c.held.rank, c.replica) for c in node_copies(tmp_path)]
    assert listed == [(0, False), (1, True)]
    copies.discard_above(4)
    assert copies.holdings() == Holdings([], {1: []})


def test_another_world_sizes_copies_count_whole_and_are_freed_at_the_new_layouts_save(
    tmp_path: Path,
):
    tier = MemoryTier(root=tmp_path)
    # 4 ranks, two a node; this node: ranks 0 and 1, with replicas of ranks 2 and 3
    for rank in (0, 1):
        source = rank + 2
        old = LocalCopies(tier, RUN, rank, 4, sources=[source])
        held.write(old.slots[0], record(7, rank=rank, world=4), b"s")
        held.write(old.next_replica_folder(source), record(7, rank=source, world=4), b"s")
        held.write(old.slots[1], record(6, rank=rank, world=4), b"s")  # 6: no replicas
    # restarted as 2 ranks, one a node: rank 0 here, rank 1 now on the other node
    new = LocalCopies(tier, RUN, 0, 2)
    whole = new.other_worlds()
    assert sorted(whole) == [(4, 7, "a")]  # step 6: ranks 2 and 3's copies are not here
    assert sorted(whole[4, 7, "a"]) == [0, 1, 2, 3]
    assert "replica-of" not in str(whole[4, 7, "a"][0][0])  # a rank's own copy first
    run_folder = new.run_folder
    new.tidy(local_ranks={0})
    assert sorted(p.name for p in run_folder.glob("rank-*")) == ["rank-00000"]
    assert list(new.folder.glob("replica-of-*")) == []
    assert new.other_worlds() == {} and node_copies(tmp_path) == []
    # a rank of this layout elsewhere, sharing the root (simulated nodes): kept, filled
    # or not
    elsewhere = LocalCopies(tier, RUN, 1, 2)
    new.tidy(local_ranks={0})
    assert elsewhere.folder.exists()
    held.write(elsewhere.slots[0], record(8, rank=1, world=2), b"s")
    new.tidy(local_ranks={0})
    assert [h.held.step for h in elsewhere.held()] == [8]


def test_a_restore_chooses_steps_every_rank_can_rebuild():
    a = {step: (step, "a") for step in (10, 20, 30)}
    every = [
        Holdings(own=[a[30], a[20]], replicas={1: [a[20], a[10]]}),
        Holdings(own=[a[10]], replicas={0: [a[20], a[10]]}),  # rank 1 lost its copies after 10
    ]
    assert _rebuildable(every, s3_latest=None) == [a[20], a[10]]  # 30: nobody holds rank 1's
    assert _rebuildable(every, s3_latest=15) == [a[20]]
    assert _rebuildable(every, s3_latest=25) == []  # S3 is newer: load from S3
    assert _fetch_plan(every, a[20]) == {1: 0}  # rank 1 receives its copy from rank 0
    assert _fetch_plan(every, a[10]) == {0: 1}


def test_copies_of_one_step_number_from_two_lineages_are_never_assembled():
    """A run rolled back to step 20 saved step 30 again ("b"); rank 1's folder on a node
    no rank of the rollback ran on kept the abandoned step 30 ("a"), and rank 1's own "b"
    copy is gone. Every rank holds a step 30, but no lineage's whole: step 20 it is."""
    every = [
        Holdings(own=[(30, "b"), (20, "a")], replicas={1: [(20, "a")]}),
        Holdings(own=[(30, "a"), (20, "a")], replicas={0: [(20, "a")]}),
    ]
    assert _rebuildable(every, s3_latest=None) == [(20, "a")]
    # rank 1's "b" copy of 30 kept as a replica on rank 0: lineage "b" is whole again
    every[0] = Holdings(own=[(30, "b"), (20, "a")], replicas={1: [(30, "b")]})
    assert _rebuildable(every, s3_latest=None) == [(30, "b"), (20, "a")]
    assert _fetch_plan(every, (30, "b")) == {1: 0}


def test_region_checksums_are_whole_regions_however_they_are_cut(monkeypatch):
    """Regions are checksummed in pieces on several threads; each CRC is the region's own."""
    from crc32c import crc32c

    monkeypatch.setattr(held, "_PIECE", 1000)  # many pieces per region, some short
    segments = [bytes(range(256)) * 40, bytes(reversed(range(256))) * 17]
    regions = [(0, 0, 10240), (0, 4096, 3001), (1, 5, 0), (1, 7, 4000), (0, 10239, 1)]
    expected = [crc32c(segments[s][o : o + n]) for s, o, n in regions]
    assert held.region_crcs(segments, regions) == expected
    records = [held.HeldRegion(*r, crc) for r, crc in zip(regions, expected, strict=True)]
    assert held.damaged_region(segments, records) is None
    damaged = bytearray(segments[1])
    damaged[7 + 2500] ^= 1  # one bit, in a middle piece of the fourth region
    assert held.damaged_region([segments[0], damaged], records) == records[3]


def test_a_reused_file_keeps_its_pages_grows_and_never_shrinks(tmp_path: Path):
    import os

    from s3ckpt.background.arena import reserved_file

    path = tmp_path / "segment-0"
    os.close(reserved_file(path, 3 * 4096))
    with pytest.raises(FileExistsError):  # a new file is never one left behind
        reserved_file(path, 4096)
    path.write_bytes(b"x" * 10000)
    os.close(reserved_file(path, 4096, reuse=True))  # smaller: kept as it is (an arena
    assert path.stat().st_size == 10000  # may map it at its own size)
    os.close(reserved_file(path, 5 * 4096, reuse=True))  # larger: grown, its pages reserved
    assert path.stat().st_size == 5 * 4096
    assert path.stat().st_blocks * 512 >= 5 * 4096
    assert path.read_bytes()[:10000] == b"x" * 10000  # the bytes it kept are not rewritten
