"""The collective timeout of a manager's save group: the job's own, and never shorter
than a save's requests may take (``deadline_s``), so that a rank cut off from its peers
ends the save everywhere within the deadline."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from s3ckpt.background.process import DEFAULT_TIMEOUT_S
from s3ckpt.config import S3Config
from s3ckpt.dcp.compat import group_timeout
from s3ckpt.manager.checkpoint_manager import _collective_timeout


@pytest.fixture
def job_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=42)
    )
    yield
    dist.destroy_process_group()


def test_group_timeout_reads_what_the_job_set(job_group):
    assert group_timeout() == 42.0
    assert group_timeout(dist.new_group([0], backend="gloo", timeout=timedelta(seconds=7))) == 7.0


def test_the_save_group_waits_the_job_timeout_or_the_deadline_whichever_is_longer(job_group):
    assert _collective_timeout(S3Config(deadline_s=5, read_timeout=1), None) == 42.0
    assert _collective_timeout(S3Config(deadline_s=100, read_timeout=2), None) == 112.0
    assert _collective_timeout(S3Config(deadline_s=None), None) == DEFAULT_TIMEOUT_S


def test_without_a_job_group_the_deadline_decides():
    assert _collective_timeout(S3Config(deadline_s=5, read_timeout=1), None) == 16.0
