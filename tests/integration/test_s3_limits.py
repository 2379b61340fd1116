"""S3's limits (10,000 parts, 5 GiB parts, 5 TiB objects), made small where a test cannot
reach them: parts are sized from the object actually written, and what cannot be stored
is refused before any byte is sent."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import ConfigError, unwrap
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer import parts

MiB = 1024 * 1024


def test_an_item_larger_than_max_object_size_gets_parts_sized_for_it(
    s3_prefix: str, make_writer: Any, make_reader: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(parts, "MAX_PARTS", 3)
    sent: Counter[str] = Counter()  # the highest part number sent, per key
    upload_part, try_parts = ObjectStore.upload_part, ObjectStore.try_parts

    async def counted(self: ObjectStore, key: str, upload_id: str, number: int, *args, **kw):
        sent[key] = max(sent[key], number)
        return await upload_part(self, key, upload_id, number, *args, **kw)

    async def counted_batch(self: ObjectStore, key: str, upload_id: str, batch: Any) -> Any:
        sent[key] = max(sent[key], *(number for number, _, _ in batch))
        return await try_parts(self, key, upload_id, batch)

    monkeypatch.setattr(ObjectStore, "upload_part", counted)
    monkeypatch.setattr(ObjectStore, "try_parts", counted_batch)
    state = {
        "small": torch.arange(1000, dtype=torch.float32),
        "huge": torch.arange(10 * MiB, dtype=torch.float32),  # 40 MiB: an object of its own
        "after": torch.ones(2 * MiB),
    }
    writer = make_writer(s3_prefix, max_object_size=5 * MiB, part_size=5 * MiB)
    dcp.save(state, storage_writer=writer)
    assert sent and max(sent.values()) <= 3, sent
    restored = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(restored, storage_reader=make_reader(s3_prefix))
    assert all(torch.equal(restored[k], v) for k, v in state.items())


def test_an_item_over_five_tib_is_refused_before_any_byte_is_sent(
    s3_prefix: str, make_writer: Any, list_keys: Any
) -> None:
    # 2**41 float32 elements (8 TiB), all of them one element in memory.
    state = {"vast": torch.zeros(1).expand(2**41), "w": torch.ones(10)}
    with pytest.raises(BaseException) as raised:
        dcp.save(state, storage_writer=make_writer(s3_prefix))
    error = unwrap(raised.value)
    assert isinstance(error, ConfigError) and "5 TiB" in str(error) and "vast" in str(error)
    assert list_keys(s3_prefix) == []


@pytest.mark.parametrize("size", [4 * MiB, 6 * 1024**4])
def test_max_object_size_outside_s3s_limits_is_refused(make_writer: Any, size: int) -> None:
    with pytest.raises(ConfigError, match="between 5 MiB and 5 TiB"):
        make_writer("s3://bucket/x", max_object_size=size)
