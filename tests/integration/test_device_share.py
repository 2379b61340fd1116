"""Shared ranges carried in device memory (``dcp.shared_read``), on CPU ranks.

On a group that carries device tensors (NCCL) a shared range bound for device memory is
fetched through the bounce slabs into device memory, sent from there and received into
device memory, then checked back through the slabs. There is no CUDA here: the two gloo
ranks of ``_device_share_worker.forced_main`` force that path for CPU destinations
(the CPU stands for the device), so everything but NCCL and the CUDA copies runs. The
CUDA and NCCL version is in ``test_gpu.py``.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import _device_share_worker as share_worker
import _dist_worker as worker
import pytest
import torch
import torch.distributed.checkpoint as dcp
from faultproxy import FaultProxy, Rule

from s3ckpt import S3StorageWriter
from s3ckpt.dcp.restore import SLAB_MIN_ITEM
from s3ckpt.testing.local_s3 import LocalS3Server

pytestmark = [pytest.mark.distributed]

MiB = 1024 * 1024
METADATA = 256 * 1024  # manifest, index and metadata objects, read once per load


@pytest.fixture(scope="module")
def reports(seaweedfs_s3: LocalS3Server, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every rank's report of the four loads, and the GET body bytes of the first two."""
    s3 = worker.server_options(seaweedfs_s3)
    base = f"s3://{seaweedfs_s3.bucket}/device-share-{secrets.token_hex(4)}"
    uris = {"raw": f"{base}/raw", "zstd": f"{base}/zstd"}
    dcp.save(share_worker.raw_state(), storage_writer=S3StorageWriter(uris["raw"], **s3),
             no_dist=True)  # fmt: skip
    writer = S3StorageWriter(uris["zstd"], compression="zstd", **s3)
    dcp.save(share_worker.zstd_state(), storage_writer=writer, no_dist=True)
    out = tmp_path_factory.mktemp("device-share")
    proxies = {case: FaultProxy(s3["endpoint_url"]) for case in ("raw", "zstd", "reread")}
    proxies["reread"].add(Rule("corrupt", methods=("GET",), match="/data", after=5 * MiB, limit=1))
    with proxies["raw"], proxies["zstd"], proxies["reread"]:
        through = {case: {**s3, "endpoint_url": p.endpoint_url} for case, p in proxies.items()}
        worker.run_ranks(share_worker.forced_main, 2, s3, through, uris, str(out), timeout=240)
    fetched = {case: proxies[case].body_bytes["GET"] for case in ("raw", "zstd")}
    ranks = [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return {"ranks": ranks, "fetched": fetched, "corrupted": proxies["reread"].counts["corrupt"]}


def test_device_ranges_are_read_once_and_arrive_bit_exact_in_device_memory(reports):
    ranks = reports["ranks"]
    for rank, report in enumerate(ranks):
        raw = report["raw"]
        assert raw["error"] is None, (rank, raw["error"])
        assert all(raw["exact"].values()), (rank, raw["exact"])
        assert raw["sent_from_device"] and all(raw["sent_from_device"]), rank
    stored = share_worker.tensor_bytes(share_worker.raw_state())
    print(f"device-carried, 2 ranks: GET bytes / stored = {reports['fetched']['raw'] / stored:.3f}")
    assert reports["fetched"]["raw"] <= stored + METADATA, (reports["fetched"], stored)
    # Every tensor byte reached the rank that did not fetch it, device memory to device
    # memory; only the planner's bytes ("step") went through host memory.
    moved = {route: sum(r["raw"]["received"].get(route, 0) for r in ranks)
             for route in ("device:cpu", "host:cpu")}  # fmt: skip
    assert moved["device:cpu"] == stored, moved
    assert 0 < moved["host:cpu"] < 4096, moved
    assert sum(r["raw"]["sent"]["device:cpu"] for r in ranks) == stored


def test_device_ranges_hold_host_memory_to_the_slabs(reports):
    for rank, report in enumerate(reports["ranks"]):
        raw = report["raw"]
        # no host buffer of an item's size: the large items passed through the slabs
        assert all(n < SLAB_MIN_ITEM for n in raw["host_buffers"]), (rank, raw["host_buffers"])
        assert raw["checkouts"], rank
        for size, count, _ in raw["checkouts"]:
            assert size * count <= share_worker.BOUNCE, raw["checkouts"]
        assert 0 < raw["most_held"] <= 2, raw["most_held"]
        # the transposed "t" lands in a device buffer on the fetching and receiving rank
        assert (8 * MiB, "cpu") in raw["device_buffers"], raw["device_buffers"]


def test_compressed_items_are_decoded_once_then_carried_in_device_memory(reports):
    ranks = reports["ranks"]
    for rank, report in enumerate(ranks):
        assert report["zstd"]["error"] is None, (rank, report["zstd"]["error"])
        assert all(report["zstd"]["exact"].values()), (rank, report["zstd"]["exact"])
    incompressible = 4 * MiB  # "w"; the zeros compress to almost nothing
    assert reports["fetched"]["zstd"] <= 1.1 * incompressible + METADATA, reports["fetched"]
    # One host buffer of the transposed zeros' size, for its decoding on the rank that
    # fetched it; the other received it into device memory.
    large = [n for r in ranks for n in r["zstd"]["host_buffers"] if n >= SLAB_MIN_ITEM]
    assert large == [16 * MiB], large
    assert sum(r["zstd"]["received"]["device:cpu"] for r in ranks) == 20 * MiB


def test_bytes_damaged_between_ranks_fail_the_load_on_every_rank(reports):
    for rank, report in enumerate(reports["ranks"]):
        error = report["damaged"]["error"]
        assert error is not None and error.startswith("CorruptCheckpointError"), (rank, error)
        assert "passed on by rank" in error, (rank, error)


def test_a_rank_that_cannot_fetch_fails_every_rank_with_its_error(reports):
    for report in reports["ranks"]:
        error = report["failing"]["error"]
        assert error is not None and "injected: rank 1 cannot read its share" in error, error


def test_a_damaged_range_shared_in_host_memory_is_read_again_as_it_was_prepared(reports):
    """Destinations that would take the slabs alone, shared in host memory: a damaged GET
    is read again into the host buffer the item was given, not through slabs."""
    assert reports["corrupted"] == 1
    for rank, report in enumerate(reports["ranks"]):
        assert report["reread"]["error"] is None, (rank, report["reread"]["error"])
        assert all(report["reread"]["exact"].values()), (rank, report["reread"]["exact"])
