"""Save and load through DCP against the real local S3 server: every byte comes back."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3_servers import ON_BOTH

pytestmark = [ON_BOTH]  # SeaweedFS and moto

MiB = 1024 * 1024


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(100, generator=g).to(torch.float16),
        "fp32": torch.randn(64, 64, generator=g),
        "fp64": torch.randn(5, 3, generator=g).double(),
        "int8": torch.randint(-128, 127, (50,), generator=g, dtype=torch.int8),
        "int16": torch.randint(-(2**15), 2**15 - 1, (7,), generator=g, dtype=torch.int16),
        "int32": torch.randint(-(2**31), 2**31 - 1, (7,), generator=g, dtype=torch.int32),
        "int64": torch.randint(-(2**62), 2**62, (9, 2), generator=g, dtype=torch.int64),
        "uint8": torch.randint(0, 255, (11,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(13, generator=g) > 0.5,
        "complex64": torch.randn(6, generator=g, dtype=torch.complex64),
        "complex128": torch.randn(2, 2, generator=g, dtype=torch.complex128),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "non_contiguous": torch.arange(60, dtype=torch.float32).reshape(6, 10).t(),
        "strided_slice": torch.arange(100, dtype=torch.int64)[::3],
        "nested": {"inner": torch.ones(3), "step": 42, "name": "run ü/1", "ids": [1, 2, 3]},
        "extra": {"lr": 0.001, "schedule": ("cosine", 10)},
    }


def _zeros_like(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = (
                torch.zeros_like(value.contiguous()) if value.numel() else torch.empty_like(value)
            )
        elif isinstance(value, dict):
            out[key] = _zeros_like(value)
        else:
            out[key] = None
    return out


def _assert_same(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert actual[key].dtype == value.dtype, key
            assert actual[key].shape == value.shape, key
            assert torch.equal(actual[key], value), key
        elif isinstance(value, dict):
            _assert_same(value, actual[key])
        else:
            assert actual[key] == value, key


def test_every_dtype_and_shape_round_trips_bit_exact(s3_prefix, make_writer, make_reader):
    state = _state()
    dcp.save(state, storage_writer=make_writer(s3_prefix))
    restored = _zeros_like(state)
    dcp.load(restored, storage_reader=make_reader(s3_prefix))
    _assert_same(state, restored)


def test_tensors_larger_than_one_part_use_multipart(s3_prefix, make_writer, make_reader, list_keys):
    big = torch.randn(3 * MiB)  # 12 MiB
    odd = torch.randint(0, 255, (7 * MiB + 13,), dtype=torch.uint8)
    state = {"big": big, "odd": odd, "small": torch.ones(3)}
    dcp.save(state, storage_writer=make_writer(s3_prefix, part_size=5 * MiB))
    restored = {"big": torch.zeros_like(big), "odd": torch.zeros_like(odd), "small": torch.zeros(3)}
    dcp.load(restored, storage_reader=make_reader(s3_prefix, request_size=3 * MiB))
    _assert_same(state, restored)
    assert [k for k in list_keys(s3_prefix) if k.startswith("data/")] == [
        k for k in list_keys(s3_prefix) if k.startswith("data/r00000-")
    ]


@pytest.mark.parametrize("checksums", [True, False], ids=["crc32c", "no-checksums"])
def test_every_kind_of_part_carries_a_checksum_the_server_accepts(
    s3_prefix, make_writer, make_reader, caplog, checksums
):
    """Parts joined from small items, a part topping up a shared one, block-aligned parts
    of a large item (CRC combined from its blocks) and a single PUT: the server checks
    each CRC32C, and a wrong one would show up as a BadDigest retry."""
    g = torch.Generator().manual_seed(7)
    state = {
        **{f"small.{i}": torch.randn(1000 + i, generator=g) for i in range(50)},
        "large": torch.randn(5 * MiB + 3, generator=g),  # 20 MiB + 12 bytes
        "tail": torch.randn(77, generator=g),
    }
    with caplog.at_level(logging.INFO, logger="s3ckpt.s3.retry"):
        dcp.save(state, storage_writer=make_writer(s3_prefix, checksums=checksums))
        dcp.save(
            {"one": torch.ones(5)},
            storage_writer=make_writer(f"{s3_prefix}-put", checksums=checksums),
        )
    assert "retry" not in caplog.text
    restored = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(restored, storage_reader=make_reader(s3_prefix))
    _assert_same(state, restored)


def test_many_small_tensors_are_packed_into_few_objects(
    s3_prefix, make_writer, make_reader, list_keys
):
    state = {f"layer{i}.weight": torch.full((16,), float(i)) for i in range(300)}
    dcp.save(state, storage_writer=make_writer(s3_prefix))
    keys = list_keys(s3_prefix)
    assert len([k for k in keys if k.startswith("data/")]) == 1
    assert "manifest.json" in keys
    restored = {k: torch.zeros(16) for k in state}
    dcp.load(restored, storage_reader=make_reader(s3_prefix))
    _assert_same(state, restored)


def test_max_object_size_splits_a_rank_into_several_objects(
    s3_prefix, make_writer, make_reader, list_keys
):
    state = {f"t{i}": torch.full((MiB,), float(i)) for i in range(6)}  # 4 MiB each
    dcp.save(state, storage_writer=make_writer(s3_prefix, max_object_size=9 * MiB))
    assert len([k for k in list_keys(s3_prefix) if k.startswith("data/")]) == 3
    restored = {k: torch.zeros(MiB) for k in state}
    dcp.load(restored, storage_reader=make_reader(s3_prefix))
    _assert_same(state, restored)


def test_checkpoint_id_can_be_passed_to_dcp(s3_prefix, make_writer, make_reader):
    state = {"w": torch.arange(10.0)}
    dcp.save(state, checkpoint_id=s3_prefix, storage_writer=make_writer())
    restored = {"w": torch.zeros(10)}
    dcp.load(restored, checkpoint_id=s3_prefix, storage_reader=make_reader())
    _assert_same(state, restored)


def test_loads_into_non_contiguous_and_differently_laid_out_destinations(
    s3_prefix, make_writer, make_reader
):
    state = {"w": torch.arange(24, dtype=torch.float32).reshape(4, 6)}
    dcp.save(state, storage_writer=make_writer(s3_prefix))
    target = torch.zeros(6, 4).t()  # a (4, 6) view that is not contiguous
    restored = {"w": target}
    dcp.load(restored, storage_reader=make_reader(s3_prefix))
    assert torch.equal(target, state["w"])


def test_keys_with_unicode_spaces_and_slashes(local_s3, make_writer, make_reader):
    uri = f"s3://{local_s3.bucket}/runs/ünï cödé/step 7/rank+0"
    state = {"a/b c.ü": torch.arange(5.0), "x": {"y/z": torch.ones(2)}}
    dcp.save(state, storage_writer=make_writer(uri))
    restored = {"a/b c.ü": torch.zeros(5), "x": {"y/z": torch.zeros(2)}}
    dcp.load(restored, storage_reader=make_reader(uri))
    _assert_same(state, restored)


def _trained_one_step() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and its AdamW optimizer after one step, so both have state."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_nn_module_and_optimizer_state(s3_prefix, make_writer, make_reader):
    torch.manual_seed(0)
    model, optimizer = _trained_one_step()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.save(state, storage_writer=make_writer(s3_prefix))

    fresh, fresh_optimizer = _trained_one_step()
    target = {"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict()}
    dcp.load(target, storage_reader=make_reader(s3_prefix))
    for key, value in model.state_dict().items():
        assert torch.equal(target["model"][key], value)
    assert torch.equal(
        target["optim"]["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )


def test_data_objects_spread_over_hashed_prefixes_load_and_list(
    s3_prefix, make_writer, make_reader, list_keys, s3_options
):
    """``spread_prefixes`` puts data objects under hashed prefixes (for AWS S3's per-prefix
    request limits); loading, listing, verifying and removing are unaffected."""
    from s3ckpt import catalog
    from s3ckpt.config import make_config

    state = {f"t{i}": torch.full((700_000,), float(i)) for i in range(6)}  # 2.7 MiB each
    writer = make_writer(s3_prefix, spread_prefixes=16, max_object_size=5 * MiB)
    dcp.save(state, storage_writer=writer)
    data = [k for k in list_keys(s3_prefix) if k.startswith("data/")]
    index = [k for k in list_keys(s3_prefix) if k.startswith("index/")]
    assert len(data) >= 3 and len(index) == 1
    assert all(len(k.split("/")) == 3 and len(k.split("/")[1]) == 1 for k in data + index)
    restored = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(restored, storage_reader=make_reader(s3_prefix))
    assert all(torch.equal(restored[k], v) for k, v in state.items())
    config = make_config(None, **s3_options)
    (info,) = catalog.list_checkpoints(s3_prefix, config=config)
    # data, index, metadata and manifest
    assert info.committed and info.ranks == 1 and info.objects == len(data) + 3
    assert catalog.verify_checkpoint(s3_prefix, config=config).ok
    catalog.remove_checkpoint(s3_prefix, config=config)
    assert list_keys(s3_prefix) == []
