"""Loads through s3ckpt's direct ranged-GET reader and through the aiobotocore fallback."""

from __future__ import annotations

import logging

import torch
import torch.distributed.checkpoint as dcp

from s3ckpt.s3.wire import UnsupportedResponse
from s3ckpt.s3.wire.get_exchange import RangedGets

MiB = 1024 * 1024


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(3 * MiB, generator=g),  # 12 MiB: several ranged GETs
        "bf16": torch.randn(1000, 77, generator=g).to(torch.bfloat16),
        **{f"small.{i}": torch.randn(i + 1, generator=g) for i in range(40)},
    }


def _load(reader) -> dict[str, torch.Tensor]:
    restored = {k: torch.zeros_like(v) for k, v in _state().items()}
    dcp.load(restored, storage_reader=reader)
    return restored


def _assert_same(restored: dict[str, torch.Tensor]) -> None:
    for key, value in _state().items():
        assert torch.equal(restored[key], value), key


def test_direct_and_aiobotocore_reads_return_the_same_bytes(s3_prefix, make_writer, make_reader):
    dcp.save(_state(), storage_writer=make_writer(s3_prefix))
    _assert_same(_load(make_reader(s3_prefix, request_size=5 * MiB)))
    _assert_same(_load(make_reader(s3_prefix, request_size=5 * MiB, direct_reads=False)))


def test_an_endpoint_answering_oddly_falls_back_to_aiobotocore(
    s3_prefix, make_writer, make_reader, monkeypatch, caplog
):
    dcp.save(_state(), storage_writer=make_writer(s3_prefix))
    calls = []

    async def unsupported(self, bucket, key, start, end):
        calls.append(key)
        raise UnsupportedResponse("chunked response")

    monkeypatch.setattr(RangedGets, "open", unsupported)
    # a config of its own, so that the fallback does not outlive this test
    with caplog.at_level(logging.WARNING, logger="s3ckpt.s3.client"):
        _assert_same(_load(make_reader(s3_prefix, read_timeout=119.0)))
        tried = len(calls)
        _assert_same(_load(make_reader(s3_prefix, read_timeout=119.0)))
    assert tried >= 1
    assert len(calls) == tried  # after the first odd answer, every read went to aiobotocore
    assert "fall back to aiobotocore: chunked response" in caplog.text


def test_a_server_that_ignores_range_still_loads_bit_exact(
    local_s3, s3_prefix, make_writer, make_reader, caplog
):
    """Every ranged GET answered 200 with the whole object: bytes must land where they
    belong, not be reported as corruption. (Stripping Range in a proxy breaks header
    signatures, so this runs the direct reader, whose presigned URLs do not sign Range;
    the aiobotocore path is covered in tests/unit/s3/test_get_attempt.py.)"""
    from faultproxy import FaultProxy

    dcp.save(_state(), storage_writer=make_writer(s3_prefix))
    with FaultProxy(local_s3.endpoint_url, ignore_range=True) as proxy:
        reader = make_reader(s3_prefix, endpoint_url=proxy.endpoint_url, request_size=MiB)
        with caplog.at_level(logging.WARNING):
            _assert_same(_load(reader))
    assert "ignores Range" in caplog.text
