"""A failed save leaves nothing behind: no manifest, no objects, no open multipart uploads."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

MiB = 1024 * 1024


class _PlannerFailingAt(DefaultSavePlanner):
    """Resolves items normally until ``fqn``, then fails as a broken GPU copy would."""

    def __init__(self, fqn: str) -> None:
        super().__init__()
        self.fqn = fqn

    def resolve_data(self, write_item):
        if write_item.index.fqn == self.fqn:
            raise RuntimeError(f"cannot stage {self.fqn}")
        return super().resolve_data(write_item)


def _state():
    return {f"t{i}": torch.full((MiB,), float(i)) for i in range(8)}  # 8 x 4 MiB


def test_a_failure_mid_upload_aborts_uploads_and_deletes_objects(
    s3_prefix, make_writer, list_keys, pending_uploads
):
    writer = make_writer(s3_prefix, part_size=5 * MiB)
    with pytest.raises(BaseException, match="cannot stage t6"):
        dcp.save(_state(), storage_writer=writer, planner=_PlannerFailingAt("t6"))
    assert pending_uploads(s3_prefix) == []
    assert list_keys(s3_prefix) == []


def test_a_failed_overwrite_leaves_the_previous_checkpoint_intact(
    s3_prefix, make_writer, make_reader, list_keys, pending_uploads
):
    state = _state()
    dcp.save(state, storage_writer=make_writer(s3_prefix, part_size=5 * MiB))
    before = list_keys(s3_prefix)
    with pytest.raises(BaseException, match="cannot stage t3"):
        dcp.save(
            {k: v + 100 for k, v in state.items()},
            storage_writer=make_writer(s3_prefix, part_size=5 * MiB, overwrite=True),
            planner=_PlannerFailingAt("t3"),
        )
    assert list_keys(s3_prefix) == before
    assert pending_uploads(s3_prefix) == []
    restored = {k: torch.zeros(MiB) for k in state}
    dcp.load(restored, storage_reader=make_reader(s3_prefix))
    for key, value in state.items():
        assert torch.equal(restored[key], value)


def test_an_object_that_cannot_be_serialized_fails_cleanly(s3_prefix, make_writer, list_keys):
    state = {"w": torch.ones(4), "bad": {"fn": lambda x: x}}
    with pytest.raises(BaseException, match=r"(?i)pickle"):
        dcp.save(state, storage_writer=make_writer(s3_prefix))
    assert list_keys(s3_prefix) == []
