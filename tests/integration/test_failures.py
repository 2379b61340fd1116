"""A failed save leaves nothing behind: no manifest, no objects, no open multipart uploads."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp
from faultproxy import FaultProxy, Rule
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from s3ckpt import S3StorageWriter, catalog, unwrap
from s3ckpt.config import make_config

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]
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


def _failing_completes(proxy) -> None:
    """Every CompleteMultipartUpload refused (501, not retried): the save fails with each
    of its uploads open and its id known."""
    proxy.add(Rule("not_implemented", methods=("POST",), match="uploadId=", per_request=None))


def _save_through(proxy, s3_options, uri: str) -> None:
    options = {**s3_options, "endpoint_url": proxy.endpoint_url, "part_size": 5 * MiB}
    writer = S3StorageWriter(uri, max_object_size=8 * MiB, **options)
    with pytest.raises(BaseException) as info:
        dcp.save(_state(), storage_writer=writer)
    assert "CompleteMultipartUpload" in str(unwrap(info.value)), unwrap(info.value)


def test_a_clean_up_that_cannot_list_still_aborts_every_upload_it_knows(
    local_s3, s3_prefix, s3_options, list_keys, pending_uploads
):
    """Uploads whose id is known are aborted without listing: a store that fails every
    ListMultipartUploads still gets every upload of the failed save aborted."""
    with FaultProxy(local_s3.endpoint_url, seed=3) as proxy:
        _failing_completes(proxy)
        proxy.add(Rule("slowdown", methods=("GET",), match="uploads", per_request=None))
        _save_through(proxy, s3_options, s3_prefix)
        assert proxy.counts["not_implemented"] >= 1  # the completes failed
        assert proxy.counts["slowdown"] == 0  # no listing was needed
    assert pending_uploads(s3_prefix) == []
    assert list_keys(s3_prefix) == []


def test_one_failing_abort_stops_none_of_the_rest_and_gc_finds_what_was_left(
    local_s3, s3_prefix, s3_options, list_keys, pending_uploads, caplog
):
    with FaultProxy(local_s3.endpoint_url, seed=3) as proxy:
        _failing_completes(proxy)
        proxy.add(
            Rule(
                "not_implemented", methods=("DELETE",), match="-0000.bin?uploadId", per_request=None
            )
        )
        with caplog.at_level(logging.WARNING, logger="s3ckpt.transfer.upload"):
            _save_through(proxy, s3_options, s3_prefix)
    left = pending_uploads(s3_prefix)
    assert len(left) == 1 and left[0].endswith("-0000.bin"), left
    assert list_keys(s3_prefix) == []  # the deletes ran all the same
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "-0000.bin not aborted" in logged, logged
    report = catalog.collect_garbage(s3_prefix, grace=0, config=make_config(None, **s3_options))
    assert [u.key.rsplit("/", 1)[-1] for u in report.uploads] == [left[0].rsplit("/", 1)[-1]]
    assert pending_uploads(s3_prefix) == []
