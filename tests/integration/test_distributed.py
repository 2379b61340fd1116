"""Multi-process DCP saves and loads over gloo against the local S3 server.

Two jobs of ranks: a 2-rank job saves and
reloads a per-rank state and saves a DTensor state sharded on 2 ranks; a 4-rank job
saves and reloads its own per-rank state and loads the DTensor checkpoint resharded onto
4 ranks. Ranks leave reports that the tests below check; the single-process reshard
(DTensor checkpoint into plain full-size tensors) runs in the test process itself.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _dist_worker as worker
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist_worker import server_options

from s3ckpt import S3StorageReader
from s3ckpt.format.manifest import MANIFEST_NAME
from s3ckpt.testing.local_s3 import LocalS3Server

pytestmark = [pytest.mark.distributed]

DATA_KEY = re.compile(r"^data/r(\d{5})-[0-9a-f]+-\d{4}\.bin$")
METADATA_KEY = re.compile(r"^metadata-[0-9a-f]+\.pkl$")


@dataclass
class Job:
    uris: dict[str, str]
    reports: list[dict[str, Any]]


def load_reports(out_dir: Path, world_size: int) -> list[dict[str, Any]]:
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


@pytest.fixture(scope="module")
def base_uri(seaweedfs_s3: LocalS3Server) -> str:
    return f"s3://{seaweedfs_s3.bucket}/test_distributed-{secrets.token_hex(4)}"


@pytest.fixture(scope="module")
def two_rank_job(
    seaweedfs_s3: LocalS3Server, base_uri: str, tmp_path_factory: pytest.TempPathFactory
) -> Job:
    out = tmp_path_factory.mktemp("ranks2")
    uris = {"per_rank": f"{base_uri}/per-rank-ws2", "dtensor": f"{base_uri}/dtensor-ws2"}
    worker.run_ranks(worker.two_rank_main, 2, server_options(seaweedfs_s3), uris, str(out))
    return Job(uris, load_reports(out, 2))


@pytest.fixture(scope="module")
def four_rank_job(
    seaweedfs_s3: LocalS3Server,
    base_uri: str,
    two_rank_job: Job,
    tmp_path_factory: pytest.TempPathFactory,
) -> Job:
    out = tmp_path_factory.mktemp("ranks4")
    uris = {"per_rank": f"{base_uri}/per-rank-ws4", "dtensor": two_rank_job.uris["dtensor"]}
    worker.run_ranks(worker.four_rank_main, 4, server_options(seaweedfs_s3), uris, str(out))
    return Job(uris, load_reports(out, 4))


def stored_keys(server: LocalS3Server, uri: str) -> list[str]:
    """Keys under the checkpoint prefix, relative to it; no multipart upload may be pending."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    client = server.client()
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix + "/"
    ):
        keys += [obj["Key"].removeprefix(prefix + "/") for obj in page.get("Contents", [])]
    pending = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])
    assert pending == [], f"multipart uploads left behind under {uri}: {pending}"
    return keys


def assert_layout(server: LocalS3Server, uri: str, world_size: int) -> None:
    """One manifest, one metadata object, data and index objects from every rank, nothing
    else; the manifest lists indexes, not items."""
    keys = stored_keys(server, uri)
    assert keys.count(MANIFEST_NAME) == 1, sorted(keys)
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    manifest = json.loads(
        server.client().get_object(Bucket=bucket, Key=f"{prefix}/{MANIFEST_NAME}")["Body"].read()
    )
    assert manifest["world_size"] == world_size
    data = {k: int(m.group(1)) for k in keys if (m := DATA_KEY.match(k))}
    assert set(data.values()) == set(range(world_size)), f"data objects by rank: {sorted(keys)}"
    assert all(manifest["save_id"] in k for k in data), (
        f"data objects of another save: {sorted(data)}"
    )
    assert {(o["key"], o["rank"]) for o in manifest["objects"]} == set(data.items())
    assert [k for k in keys if METADATA_KEY.match(k)] == [manifest["metadata_key"]], sorted(keys)
    indexes = {i["key"]: i["rank"] for i in manifest["indexes"]}
    assert set(indexes.values()) == set(range(world_size)) and "items" not in manifest
    assert all(key in keys for key in indexes), f"index objects missing: {sorted(keys)}"
    strays = set(keys) - set(data) - set(indexes) - {MANIFEST_NAME, manifest["metadata_key"]}
    assert not strays, f"unexpected objects under {uri}: {sorted(strays)}"


def assert_state_equal(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert set(actual) == set(expected)
    for key, want in expected.items():
        got = actual[key]
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor), key
            assert got.dtype == want.dtype and got.shape == want.shape, (key, got.dtype, got.shape)
            assert torch.equal(got, want), f"{key} differs"
        else:
            assert got == want, key


@pytest.mark.parametrize("world_size", [2, 4])
def test_per_rank_state_round_trip(
    world_size: int, request: pytest.FixtureRequest, local_s3: LocalS3Server
) -> None:
    """Every rank saves its own tensors plus a replicated one, and loads them back bit-exact."""
    job: Job = request.getfixturevalue("two_rank_job" if world_size == 2 else "four_rank_job")
    assert len(job.reports) == world_size
    for rank, report in enumerate(job.reports):
        assert_state_equal(report["per_rank"], worker.per_rank_state(rank, world_size))
    assert_layout(local_s3, job.uris["per_rank"], world_size)


def test_dtensor_checkpoint_is_sharded_across_ranks(
    two_rank_job: Job, local_s3: LocalS3Server
) -> None:
    full = worker.dtensor_full_state()
    # Shard(0) on 2 ranks: rows split ceil-first, 37 -> 19 + 18.
    for rank, report in enumerate(two_rank_job.reports):
        for key, shape in report["saved_local_shapes"].items():
            rows = full[key].shape[0]
            expected_rows = -(-rows // 2) if rank == 0 else rows - -(-rows // 2)
            assert shape == (expected_rows, *full[key].shape[1:]), (rank, key, shape)
    assert_layout(local_s3, two_rank_job.uris["dtensor"], 2)


def test_dtensor_checkpoint_loads_into_full_tensors_in_one_process(
    two_rank_job: Job, local_s3: LocalS3Server
) -> None:
    """Reshard 2 ranks -> 1 process without a process group: plain full-size tensors."""
    assert not (dist.is_available() and dist.is_initialized())
    full = worker.dtensor_full_state()
    target: dict[str, Any] = {k: torch.full_like(v, 7) for k, v in full.items()}
    target["step"] = torch.tensor(0)
    dcp.load(
        target,
        storage_reader=S3StorageReader(two_rank_job.uris["dtensor"], **server_options(local_s3)),
    )
    assert target.pop("step").item() == worker.STEP
    assert_state_equal(target, full)


def test_dtensor_checkpoint_reshards_onto_four_ranks(four_rank_job: Job) -> None:
    """Reshard Shard(0) on 2 ranks -> Shard(0) / Shard(1) on 4 ranks, uneven shapes included."""
    full = worker.dtensor_full_state()
    for rank, report in enumerate(four_rank_job.reports):
        assert report["step"].item() == worker.STEP
        assert set(report["dtensor"]) == set(worker.RESHARD_DIMS)
        for key, dim in worker.RESHARD_DIMS.items():
            got = report["dtensor"][key]
            assert got["placements"] == [f"S({dim})"], (rank, key, got["placements"])
            local, expected = got["local"], got["expected_local"]
            # The expected local shard is the rank's torch.chunk-style slice of the full tensor.
            chunk = -(-full[key].shape[dim] // 4)
            start = min(rank * chunk, full[key].shape[dim])
            assert torch.equal(expected, full[key].narrow(dim, start, expected.shape[dim])), (
                rank,
                key,
            )
            assert local.dtype == full[key].dtype and local.shape == expected.shape, (
                rank,
                key,
                local.shape,
            )
            assert torch.equal(local, expected), f"rank {rank}: local shard of {key} differs"
            assert torch.equal(got["full"], full[key]), (
                f"rank {rank}: full_tensor() of {key} differs"
            )
    # The uneven splits really happened: 37 rows over 4 -> 10,10,10,7; 5 columns -> 2,2,1,0.
    assert [r["dtensor"]["odd"]["local"].shape[0] for r in four_rank_job.reports] == [10, 10, 10, 7]
    assert [r["dtensor"]["odd2"]["local"].shape[1] for r in four_rank_job.reports] == [2, 2, 1, 0]


# -- world size 8 --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eight_rank_checkpoint(
    seaweedfs_s3: LocalS3Server, base_uri: str, tmp_path_factory: pytest.TempPathFactory
) -> Job:
    out = tmp_path_factory.mktemp("ranks8")
    uri = f"{base_uri}/dtensor-ws8"
    worker.run_ranks(
        worker.eight_rank_save_main, 8, server_options(seaweedfs_s3), uri, str(out), timeout=300
    )
    return Job({"dtensor": uri}, load_reports(out, 8))


def test_eight_ranks_save_a_2d_sharded_checkpoint_with_one_index_per_rank(
    eight_rank_checkpoint: Job, local_s3: LocalS3Server
) -> None:
    full = worker.dtensor_full_state()
    for report in eight_rank_checkpoint.reports:
        for key, shape in report["saved_local_shapes"].items():
            assert len(shape) == 2 and shape[0] <= -(-full[key].shape[0] // 2), (key, shape)
    assert_layout(local_s3, eight_rank_checkpoint.uris["dtensor"], 8)


@pytest.mark.parametrize("world_size", [8, 3, 2])
def test_eight_rank_checkpoint_loads_on_8_3_and_2_ranks(
    world_size: int,
    eight_rank_checkpoint: Job,
    seaweedfs_s3: LocalS3Server,
    tmp_path: Path,
) -> None:
    """Every rank gets its shard bit-exact; with the reader given the group, only its rank 0
    reads the manifest and the metadata (the others receive them by broadcast), and each
    rank reads the index objects of just the ranks whose data it loads. Given no group,
    every rank reads them itself (no collective is issued on a group s3ckpt guessed)."""
    uri = eight_rank_checkpoint.uris["dtensor"]
    worker.run_ranks(
        worker.reshard_load_main,
        world_size,
        server_options(seaweedfs_s3),
        uri,
        str(tmp_path),
        timeout=300,
    )
    reports = load_reports(tmp_path, world_size)
    full = worker.dtensor_full_state()
    extras: list[set[int]] = []
    for rank, report in enumerate(reports):
        assert report["step"].item() == worker.STEP
        assert report["unshared_step"].item() == worker.STEP
        alone = [k.rsplit("/", 1)[-1] for k in report["unshared_gets"]]
        assert alone.count(MANIFEST_NAME) == 1, (rank, alone)
        assert len([k for k in alone if METADATA_KEY.match(k)]) == 1, (rank, alone)
        for key, got in report["tensors"].items():
            assert torch.equal(got["local"], got["expected_local"]), (rank, key)
            assert torch.equal(got["full"], full[key]), (rank, key)
        gets = [key.rsplit("/", 2)[-2:] for key in report["gets"]]
        shared = [g for g in gets if g[-1] == MANIFEST_NAME or METADATA_KEY.match(g[-1])]
        assert len(shared) == (2 if rank == 0 else 0), (rank, report["gets"])
        read = [int(g[-1][1:6]) for g in gets if g[0] == "index"]
        assert len(set(read)) == len(read), f"rank {rank} read an index object twice"
        needed = _saving_ranks_overlapping(rank, world_size, full)
        # Only those, plus the one that stored the replicated "step".
        assert needed <= set(read) and len(set(read) - needed) <= 1, (rank, read, needed)
        extras.append(set(read) - needed)
    assert len({frozenset(e) for e in extras if e}) <= 1  # the same "step" owner for all
    if world_size == 8:
        union = set().union(*({k for k in r["gets"] if "/index/" in k} for r in reports))
        assert len(union) == 8  # every index read, by the ranks that needed it


def _split(size: int, parts: int) -> list[tuple[int, int]]:
    """How DTensor's Shard splits ``size`` over ``parts`` ranks (torch.chunk: ceil-sized)."""
    chunk = -(-size // parts)
    return [(min(k * chunk, size), min((k + 1) * chunk, size)) for k in range(parts)]


def _saving_ranks_overlapping(rank: int, world_size: int, full: dict[str, Any]) -> set[int]:
    """The ranks of the 2x4 save whose shards overlap what ``rank`` of ``world_size`` loads."""
    dim = world_size % 2
    rows_of, cols_of = worker.SAVE_MESH
    needed = set()
    for tensor in full.values():
        wanted = [(0, tensor.shape[0]), (0, tensor.shape[1])]
        wanted[dim] = _split(tensor.shape[dim], world_size)[rank]
        for i, rows in enumerate(_split(tensor.shape[0], rows_of)):
            for j, cols in enumerate(_split(tensor.shape[1], cols_of)):
                held = [rows, cols]
                if all(
                    min(a[1], b[1]) > max(a[0], b[0]) for a, b in zip(held, wanted, strict=True)
                ):
                    needed.add(i * cols_of + j)
    return needed
