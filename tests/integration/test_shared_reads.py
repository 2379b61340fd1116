"""Replicated state read once: with the reader given the group, a multi-rank load GETs
each stored byte about once, however many ranks hold a copy.

GET body bytes are counted by a proxy in front of the server; ranks load DDP (4 full
copies) and HSDP (2 replicas x 2 shards) layouts, bit-exact on every rank, with and
without the group.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import _dist_worker as worker
import _shared_read_worker as shared_worker
import pytest
import torch
import torch.distributed.checkpoint as dcp
from faultproxy import FaultProxy

from s3ckpt import S3StorageWriter
from s3ckpt.testing.local_s3 import LocalS3Server
from s3ckpt.transfer.shares import plan_shares

pytestmark = [pytest.mark.distributed]


@pytest.fixture(scope="module")
def checkpoint(seaweedfs_s3: LocalS3Server) -> tuple[str, dict]:
    s3 = worker.server_options(seaweedfs_s3)
    uri = f"s3://{seaweedfs_s3.bucket}/shared-reads-{secrets.token_hex(4)}"
    writer = S3StorageWriter(uri, **s3)
    dcp.save(shared_worker.full_state(), storage_writer=writer, no_dist=True)
    return uri, s3


@pytest.fixture(scope="module")
def compressed_checkpoint(seaweedfs_s3: LocalS3Server) -> tuple[str, dict]:
    s3 = worker.server_options(seaweedfs_s3)
    uri = f"s3://{seaweedfs_s3.bucket}/shared-reads-zstd-{secrets.token_hex(4)}"
    writer = S3StorageWriter(uri, compression="zstd", **s3)
    dcp.save(shared_worker.full_state(), storage_writer=writer, no_dist=True)
    return uri, s3


def _load(checkpoint, layout: str, shared: bool, tmp_path: Path) -> float:
    """GET body bytes of one 4-rank load, over the checkpoint's stored tensor bytes."""
    uri, s3 = checkpoint
    with FaultProxy(s3["endpoint_url"], seed=1) as proxy:
        through = {**s3, "endpoint_url": proxy.endpoint_url}
        worker.run_ranks(
            shared_worker.shared_load_main, 4, through, uri, str(tmp_path), layout, shared,
            timeout=240,
        )  # fmt: skip
        fetched = proxy.body_bytes["GET"]
    for rank in range(4):
        report = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert all(report["exact"].values()), (layout, shared, rank, report["exact"])
    return fetched / shared_worker.stored_bytes()


def _read_once(checkpoint, layout: str, label: str, tmp_path: Path) -> None:
    """A shared 4-rank load GETs each stored byte once (a tenth more at most)."""
    ratio = _load(checkpoint, layout, True, tmp_path)
    print(f"{label}, shared: GET bytes / stored bytes = {ratio:.3f}")
    assert ratio <= 1.1, f"{label}: GET bytes / stored bytes = {ratio:.2f}"


@pytest.mark.parametrize("layout", ["ddp", "hsdp"])
def test_a_replicated_load_reads_each_stored_byte_once(layout, checkpoint, tmp_path):
    _read_once(checkpoint, layout, layout, tmp_path)


def test_a_partial_load_shares_what_it_reads(checkpoint, tmp_path):
    ratio = _load(checkpoint, "partial", True, tmp_path)
    wanted = sum(
        t.numel() * t.element_size()
        for k, t in shared_worker.full_state().items()
        if k in ("wide", "ids")
    )
    assert ratio * shared_worker.stored_bytes() <= 1.1 * wanted


@pytest.mark.parametrize("layout", ["ddp", "hsdp"])
def test_a_compressed_checkpoint_is_read_once_too(layout, compressed_checkpoint, tmp_path):
    """A compressed item's owner decodes it and passes on the decoded bytes."""
    _read_once(compressed_checkpoint, layout, f"{layout}, zstd", tmp_path)


def test_without_a_group_every_replica_reads_for_itself(checkpoint, tmp_path):
    ratio = _load(checkpoint, "ddp", False, tmp_path)
    print(f"ddp, unshared: GET bytes / stored bytes = {ratio:.3f}")
    assert 3.9 <= ratio <= 4.2, ratio


def test_a_rank_that_cannot_fetch_its_share_fails_every_rank_with_its_error(checkpoint, tmp_path):
    uri, s3 = checkpoint
    worker.run_ranks(
        shared_worker.shared_load_main, 4, s3, uri, str(tmp_path), "ddp", True, 2, timeout=240
    )
    errors = [torch.load(tmp_path / f"rank{r}.pt")["error"] for r in range(4)]
    assert all("injected: rank 2 cannot read its share" in e for e in errors), errors


def test_the_plan_balances_shared_ranges_and_leaves_single_needs_alone():
    big, small = ("data/a", 0, 100), ("data/a", 100, 110)
    alone = ("data/b", 0, 50)
    plan = plan_shares([[big, small], [big, small, alone], [big]])
    assert set(plan.owners) == {big, small}  # needed by one rank only: not shared
    # Largest first, to the needing rank with the fewest bytes (rank 1 reads 50 alone).
    assert plan.owners[big] == 0 and plan.owners[small] == 1
    assert plan.receivers[big] == (1, 2) and plan.receivers[small] == (0,)
    assert plan.receives(1) == [(big, 0)] and plan.receives(0) == [(small, 1)]
    assert plan.sends(0) == [(big, 1), (big, 2)]
    assert plan.tags[big] != plan.tags[small]
    assert not plan_shares([[big], [alone]]).shared  # nothing replicated: nothing to share


def test_a_format_1_checkpoint_loads_bit_exact_with_the_group(seaweedfs_s3, tmp_path):
    from test_legacy_format import FIXTURES, RELEASES, _upload

    folder = FIXTURES / RELEASES[0]
    uri = f"s3://{seaweedfs_s3.bucket}/shared-reads-v1-{secrets.token_hex(4)}"
    _upload(seaweedfs_s3, folder / "raw", uri)
    s3 = worker.server_options(seaweedfs_s3)
    with FaultProxy(s3["endpoint_url"], seed=1) as proxy:
        through = {**s3, "endpoint_url": proxy.endpoint_url}
        worker.run_ranks(
            shared_worker.legacy_load_main, 2, through, uri, str(tmp_path),
            str(folder / "expected.pt"), timeout=240,
        )  # fmt: skip
        fetched = proxy.body_bytes["GET"]
    for rank in range(2):
        report = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert all(report["exact"].values()), (rank, report["exact"])
    data = sum(p.stat().st_size for p in (folder / "raw" / "data").rglob("*") if p.is_file())
    assert fetched < 1.5 * data + 64 * 1024, (fetched, data)  # read once, not twice
