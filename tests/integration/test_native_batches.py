"""Saves whose parts go in batches through the native sender (``s3ckpt.s3.wire.batch``)
against real servers: every part goes that way and loads byte-exact; ``native_uploads=False``
sends none that way; faults on the wire (resets, throttling, chunked error answers) are
retried through the usual path; a part refused for good fails the save with one error
and leaves no upload and no checkpoint behind."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from faultproxy import FaultProxy, Rule
from s3_servers import ON_BOTH

from s3ckpt import S3StorageReader, S3StorageWriter, StorageError, unwrap
from s3ckpt.s3.requests import Requests
from s3ckpt.s3.wire import batch as native

pytestmark = [
    pytest.mark.skipif(not native.native_batches(), reason="s3ckpt.s3.wire._sender is not built"),
    ON_BOTH,
]
MiB = 1024 * 1024
PART = 5 * MiB


class _Counting:
    """The sender, counting the requests handed to it."""

    def __init__(self, sender: Any) -> None:
        self.sender = sender
        self.batches: list[int] = []

    def exchange(self, host: str, port: int, requests: Any, *rest: Any) -> Any:
        self.batches.append(len(requests))
        return self.sender.exchange(host, port, requests, *rest)


@pytest.fixture
def sender(monkeypatch: pytest.MonkeyPatch) -> _Counting:
    counting = _Counting(native._sender)
    monkeypatch.setattr(native, "_sender", counting)
    return counting


def _state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(6 * MiB, generator=generator),  # 24 MiB: five parts
        "small": [torch.randn(1000, generator=generator) for _ in range(50)],
    }


def _round_trip(uri: str, options: dict[str, Any], seed: int = 1) -> None:
    state = _state(seed)
    dcp.save(state, storage_writer=S3StorageWriter(uri, part_size=PART, **options))
    restored = {"big": torch.zeros(6 * MiB), "small": [torch.zeros(1000) for _ in range(50)]}
    dcp.load(restored, storage_reader=S3StorageReader(uri, **options))
    assert torch.equal(restored["big"], state["big"])
    assert all(torch.equal(a, b) for a, b in zip(restored["small"], state["small"], strict=True))


def _pending_uploads(local_s3: Any, uri: str) -> list[str]:
    prefix = uri.split("/", 3)[3]
    listed = local_s3.client().list_multipart_uploads(Bucket=local_s3.bucket, Prefix=prefix)
    return [upload["Key"] for upload in listed.get("Uploads", [])]


def test_every_part_of_a_save_goes_in_native_batches(
    s3_prefix, s3_options, sender, local_s3, monkeypatch
):
    one_at_a_time: list[int] = []
    usual = Requests.try_upload_part

    async def counted(self: Requests, params: dict[str, Any], tries: Any) -> Any:
        one_at_a_time.append(params["PartNumber"])
        return await usual(self, params, tries)

    monkeypatch.setattr(Requests, "try_upload_part", counted)
    uri = f"{s3_prefix}/step-1"
    _round_trip(uri, s3_options)
    assert sum(sender.batches) >= 4  # the large tensor's parts at least
    assert len(sender.batches) < sum(sender.batches)  # batches, not one request each
    assert one_at_a_time == []  # none sent any other way
    assert _pending_uploads(local_s3, uri) == []


def test_native_uploads_off_sends_each_part_from_the_loop(s3_prefix, s3_options, sender):
    _round_trip(f"{s3_prefix}/step-1", {**s3_options, "native_uploads": False})
    assert sender.batches == []


@pytest.mark.parametrize(
    "fault, after",
    [("reset_request", 1 * MiB), ("slowdown", 0), ("chunked_error", 0), ("reset_response", -1)],
)
def test_parts_failed_on_the_wire_are_retried_and_the_save_loads(
    local_s3, s3_prefix, s3_options, sender, fault, after
):
    """The first two parts meet the fault once each; their retries go through."""
    rule = Rule(fault, methods=("PUT",), match="partNumber=", after=after, limit=2, per_request=1)
    with FaultProxy(local_s3.endpoint_url, seed=5) as proxy:
        proxy.add(rule)
        options = {**s3_options, "endpoint_url": proxy.endpoint_url}
        uri = f"{s3_prefix}/step-1"
        _round_trip(uri, options, seed=2)
        assert proxy.counts[rule.fault] >= 1, (proxy.requests, proxy.counts, sender.batches)
    assert sum(sender.batches) >= 4
    assert _pending_uploads(local_s3, uri) == []


def test_a_part_refused_for_good_fails_the_save_and_leaves_nothing(
    local_s3, s3_prefix, s3_options, sender, list_keys
):
    uri = f"{s3_prefix}/step-1"
    with FaultProxy(local_s3.endpoint_url, seed=7) as proxy:
        proxy.add(
            Rule("not_implemented", methods=("PUT",), match="partNumber=3&", per_request=None)
        )
        options = {**s3_options, "endpoint_url": proxy.endpoint_url}
        with pytest.raises(BaseException) as caught:
            dcp.save(_state(3), storage_writer=S3StorageWriter(uri, part_size=PART, **options))
    error = unwrap(caught.value)
    assert isinstance(error, StorageError), error
    assert "UploadPart" in str(error) or "NotImplemented" in str(error)
    assert sum(sender.batches) >= 3
    assert _pending_uploads(local_s3, uri) == []
    assert list_keys(uri) == []
