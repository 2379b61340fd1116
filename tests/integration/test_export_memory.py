"""Export streams: its peak memory follows the window (at least the largest tensor), not
the checkpoint. A 768 MiB checkpoint of twelve 64 MiB tensors is exported in a fresh
process, to a local folder and to an S3 prefix, and the growth of its peak resident set
over the baseline (torch and s3ckpt imported) is measured."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import S3StorageWriter
from s3ckpt.interop.output import PART_SIZE
from s3ckpt.testing.local_s3 import LocalS3Server

MiB = 1024 * 1024
TENSOR = 64 * MiB
COUNT = 12
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def checkpoint(seaweedfs_s3: LocalS3Server) -> str:
    uri = f"s3://{seaweedfs_s3.bucket}/test_export_memory-{secrets.token_hex(4)}/ckpt"
    state = {f"layers.{i}.weight": torch.full((TENSOR // 4,), float(i)) for i in range(COUNT)}
    dcp.save(
        state,
        storage_writer=S3StorageWriter(
            uri,
            endpoint_url=seaweedfs_s3.endpoint_url,
            access_key_id=seaweedfs_s3.access_key,
            secret_access_key=seaweedfs_s3.secret_key,
            region=seaweedfs_s3.region,
        ),
    )
    return uri


def measure(server: LocalS3Server, uri: str, out: str, window: int) -> dict[str, int]:
    env = {**os.environ, **server.env(), "PYTHONPATH": str(HERE.parents[1])}
    done = subprocess.run(
        [sys.executable, str(HERE / "_export_memory.py"), uri, out, str(window)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    growth = (figures["peak"] - figures["baseline"]) / MiB
    print(
        f"export of {figures['bytes'] / MiB:.0f} MiB to {out}, window {window / MiB:.0f} MiB: "
        f"peak RSS {growth:.0f} MiB over the baseline"
    )
    return figures


@pytest.mark.parametrize("to", ["folder", "s3"])
def test_peak_memory_follows_the_window_not_the_checkpoint(
    seaweedfs_s3: LocalS3Server, checkpoint: str, tmp_path: Path, to: str
) -> None:
    out = (
        str(tmp_path / "out") if to == "folder" else f"{checkpoint}-exported-{secrets.token_hex(3)}"
    )
    figures = measure(seaweedfs_s3, checkpoint, out, window=TENSOR)
    assert figures["bytes"] == TENSOR * COUNT
    growth = figures["peak"] - figures["baseline"]
    # One window (one tensor here), one upload part for S3, and a small overhead (the
    # reader's requests, DCP's plans); the whole checkpoint is twelve tensors.
    bound = TENSOR + (PART_SIZE if to == "s3" else 0) + 48 * MiB
    assert growth < bound, f"peak grew by {growth / MiB:.0f} MiB (bound {bound / MiB:.0f})"
