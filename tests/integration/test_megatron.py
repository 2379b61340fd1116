"""Megatron-core ``dist_checkpointing`` through s3ckpt on 2 gloo CPU ranks, against the
embedded SeaweedFS server (megatron-core 0.16.1).

Each test runs one spawned job (``_megatron_worker.py``; Megatron's CUDA calls stood in
for there) and checks the ranks' reports and the store: saves and loads bit-exact (sync,
async through Megatron's ``AsyncCallsQueue``, ``FullyParallelSaveStrategyWrapper``,
``checkpointing_context`` reuse), plan reuse (``--ckpt-assume-constant-structure``) over
new steps and over a committed one, a SIGKILL mid-upload, Megatron's files in S3 and no
``s3:/`` folder on disk, and wrong uses refused clearly.

Not run here, for want of a GPU: tensors on CUDA devices (their copy to host memory in
``preload_fn`` and the ``torch.cuda.synchronize`` after it), NCCL collectives, and
Megatron's persistent async worker with CUDA tensors (it receives them over CUDA IPC).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _dist_worker as dist_worker
import _megatron_worker as worker
import pytest
import torch

from s3ckpt import catalog
from s3ckpt.config import S3URI
from s3ckpt.format.manifest import MANIFEST_NAME
from s3ckpt.testing.local_s3 import LocalS3Server

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

WORLD = 2
TRACKER = "latest_checkpointed_iteration.txt"


def reports(out_dir: Path) -> list[dict[str, Any]]:
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def expected(rank: int, step: int) -> dict[str, Any]:
    values = worker.state_values(rank, WORLD, step)
    return {
        "weight": values["weight"],
        "bias": values["bias"],
        "rng": values["rng"],
        "common": values["common"],
    }


def assert_bit_exact(loaded: dict[str, Any], rank: int, step: int) -> None:
    want = expected(rank, step)
    assert torch.equal(loaded["weight"], want["weight"])
    assert torch.equal(loaded["bias"], want["bias"])
    assert torch.equal(loaded["rng"], want["rng"])
    assert loaded["common"] == want["common"]


def keys_under(server: LocalS3Server, uri: str) -> list[str]:
    location = S3URI.parse(uri)
    found: list[str] = []
    for page in server.client().get_paginator("list_objects_v2").paginate(
        Bucket=location.bucket, Prefix=location.prefix + "/"
    ):
        found += [o["Key"][len(location.prefix) + 1 :] for o in page.get("Contents", [])]
    return sorted(found)


def open_uploads(server: LocalS3Server, uri: str) -> list[str]:
    location = S3URI.parse(uri)
    answer = server.client().list_multipart_uploads(
        Bucket=location.bucket, Prefix=location.prefix + "/"
    )
    return [u["Key"] for u in answer.get("Uploads", [])]


def tracker_text(server: LocalS3Server, run: str) -> str:
    location = S3URI.parse(run)
    body = server.client().get_object(Bucket=location.bucket, Key=location.key(TRACKER))["Body"]
    return body.read().decode()


def no_local_s3_folder(workdir: Path) -> None:
    assert not [p for p in workdir.rglob("s3*") if p.is_dir()], list(workdir.rglob("*"))


@pytest.mark.parametrize("mode", ["plain", "fully_parallel", "context"])
def test_sync_save_and_resume(
    mode: str, seaweedfs_s3: LocalS3Server, s3_prefix: str, tmp_path: Path
) -> None:
    run = f"{s3_prefix}/gpt"
    s3 = dist_worker.server_options(seaweedfs_s3)
    dist_worker.run_ranks(worker.sync_main, WORLD, s3, run, str(tmp_path), mode)
    steps = (1, 2) if mode == "context" else (1,)
    for rank, report in enumerate(reports(tmp_path)):
        assert report["tracker"] == steps[-1]
        for step in steps:
            assert_bit_exact(report["loaded"][step], rank, step)
    # Megatron's files are in S3 beside the tensors, committed with them; none on disk.
    assert tracker_text(seaweedfs_s3, run) == str(steps[-1])
    for step in steps:
        assert catalog.is_committed(worker.step_dir(run, step), **s3)
        names = {item.fqn for item in catalog.show_checkpoint(worker.step_dir(run, step), **s3).items}
        assert {"__megatron_file__.common.pt/shard_0_1", "__megatron_file__.metadata.json/shard_0_1"} <= names
    assert set(keys_under(seaweedfs_s3, run)) >= {TRACKER}
    assert not [k for k in keys_under(seaweedfs_s3, run) if k.endswith(("common.pt", "metadata.json"))]
    no_local_s3_folder(tmp_path)
