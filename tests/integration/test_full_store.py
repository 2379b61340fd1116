"""A real store made to fill: SeaweedFS (``weed mini``) with its data on a 64 MiB tmpfs.

What SeaweedFS does when its disk cannot take another volume: it answers uploads with
``500 InternalError`` ("We encountered an internal error, please try again"; its log says
"No writable volumes and no free volumes left"). It does not hang, and its answer does
not say "full": s3ckpt cannot tell it from a passing server error, so it is retried until
``deadline_s`` and the save ends with ``DeadlineExceededError`` naming ``InternalError``,
as any persistent 5xx does. The stall limit is for stores that stop answering (Ceph RGW
on a full cluster: ``test_stalled_store.py``); stores that say "full" in S3's words get
``StoreFullError`` (``tests/unit/s3/test_retry_stalls.py``). moto keeps objects in memory
and never fills. Either way the previous checkpoint stays the loadable one.

Mounting the tmpfs needs root (or CAP_SYS_ADMIN); without it the test is skipped and says
why.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import (
    DeadlineExceededError,
    S3StorageReader,
    S3StorageWriter,
    StoreFullError,
    StoreStalledError,
    unwrap,
)
from s3ckpt.testing.local_s3 import LocalS3Server

MiB = 1024 * 1024
DEADLINE_S = 4.0


@pytest.fixture
def full_seaweedfs(tmp_path: Path) -> Iterator[LocalS3Server]:
    """SeaweedFS on a 64 MiB tmpfs of its own, unmounted afterwards whatever happened."""
    data = tmp_path / "weed"
    data.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs for a store to fill needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(data)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        with LocalS3Server(data_dir=data) as server:
            yield server
    finally:
        subprocess.run(["umount", "-l", str(data)], check=False)


def test_a_seaweedfs_that_filled_up_fails_the_save_at_its_deadline_and_keeps_the_previous(
    full_seaweedfs,
):
    server = full_seaweedfs
    options = {
        "endpoint_url": server.endpoint_url,
        "access_key_id": server.access_key,
        "secret_access_key": server.secret_key,
        "region": server.region,
        "part_size": 8 * MiB,
        "deadline_s": DEADLINE_S,
    }
    uri = f"s3://{server.bucket}/filled"
    previous = {"w": torch.arange(1024.0)}
    dcp.save(previous, storage_writer=S3StorageWriter(f"{uri}/step-1", **options))

    failure = None
    started = time.monotonic()
    for step in range(2, 8):  # 32 MiB a save: the disk runs out of room for volumes
        state = {"w": torch.full((8 * MiB,), float(step))}
        try:
            dcp.save(state, storage_writer=S3StorageWriter(f"{uri}/step-{step}", **options))
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            failure = unwrap(exc)
            break
        started = time.monotonic()
    took = time.monotonic() - started
    assert failure is not None, "the 64 MiB store took every save"
    assert isinstance(failure, DeadlineExceededError), repr(failure)
    assert not isinstance(failure, (StoreStalledError, StoreFullError))
    assert "InternalError" in str(failure) and "deadline_s" in str(failure)
    assert took < DEADLINE_S + 15, took  # the deadline, one request and the clean-up

    loaded = {"w": torch.zeros(1024)}
    dcp.load(loaded, storage_reader=S3StorageReader(f"{uri}/step-1", **options))
    assert torch.equal(loaded["w"], previous["w"])
