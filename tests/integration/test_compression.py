"""zstd compression end to end: every dtype round-trips, ranged loads decode only what they
need, and the manifest, ``s3ckpt show`` and ``s3ckpt verify`` know each item's codec."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from stored import stored_manifest
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from s3ckpt import CorruptCheckpointError, unwrap
from s3ckpt.cli.main import main as cli
from s3ckpt.config import S3URI
from s3ckpt.format.manifest import Manifest

MiB = 1024 * 1024


def _weights(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype)


def _state() -> dict:
    return {
        "bf16": _weights(1024, 1024, dtype=torch.bfloat16),  # 2 MiB, byte-grouped
        "fp32": _weights(3 * MiB, seed=1),  # 12 MiB: two checksum blocks
        "fp16": _weights(333, dtype=torch.float16),
        "fp64": _weights(77, dtype=torch.float64),
        "ints": torch.arange(100_000, dtype=torch.int64),  # plain zstd
        "noise": torch.randint(0, 256, (300_000,), dtype=torch.uint8),  # incompressible: raw
        "bools": torch.zeros(1000, dtype=torch.bool),
        "scalar": torch.tensor(1.5),
        "empty": torch.empty(0, 3),
        "extra": {"step": 7, "note": "compressed"},
    }


def _manifest(local_s3, uri: str) -> Manifest:
    return stored_manifest(local_s3.client(), uri)


def _flip_a_bit_in(local_s3, uri: str, item) -> None:
    """Damage the stored bytes of ``item`` (a :class:`StoredItem`) in the middle."""
    location = S3URI.parse(uri)
    client = local_s3.client()
    key = location.key(item.key)
    body = bytearray(client.get_object(Bucket=location.bucket, Key=key)["Body"].read())
    body[item.offset + item.length // 2] ^= 0x01
    client.put_object(Bucket=location.bucket, Key=key, Body=bytes(body))


def _zeros(state: dict) -> dict:
    return {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else dict.fromkeys(v)
        for k, v in state.items()
    }


def test_compressed_checkpoint_round_trips_and_records_codecs(
    local_s3, s3_prefix, make_writer, make_reader
):
    state = _state()
    dcp.save(state, storage_writer=make_writer(s3_prefix, compression="zstd"))
    restored = _zeros(state)
    dcp.load(restored, storage_reader=make_reader(s3_prefix))
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(restored[key], value), key
    assert restored["extra"] == state["extra"]
    codecs = {item.fqn: item.stored.codec for item in _manifest(local_s3, s3_prefix).items}
    assert codecs["bf16"] == codecs["fp32"] == codecs["fp16"] == "zstd-bg"
    assert codecs["ints"] == codecs["bools"] == "zstd"
    assert codecs["noise"] == "raw"
    items = {item.fqn: item.stored for item in _manifest(local_s3, s3_prefix).items}
    assert items["bf16"].length < 0.8 * items["bf16"].size


def test_show_and_verify_understand_compressed_items(
    local_s3, s3_prefix, make_writer, capsys, monkeypatch
):
    for name, value in local_s3.env().items():
        monkeypatch.setenv(name, value)
    dcp.save(_state(), storage_writer=make_writer(s3_prefix, compression="zstd"))
    assert cli(["show", s3_prefix, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert "zstd-bg" in json.dumps(shown)
    assert cli(["verify", s3_prefix]) == 0
    capsys.readouterr()

    manifest = _manifest(local_s3, s3_prefix)
    item = next(i.stored for i in manifest.items if i.fqn == "fp32")
    location = S3URI.parse(s3_prefix)
    client = local_s3.client()
    key = location.key(item.key)
    body = bytearray(client.get_object(Bucket=location.bucket, Key=key)["Body"].read())
    body[item.offset + item.frames[0] + 100] ^= 0x10  # inside the second block's frame
    client.put_object(Bucket=location.bucket, Key=key, Body=bytes(body))
    assert cli(["verify", s3_prefix]) == 1
    assert "fp32" in capsys.readouterr().out


def test_a_damaged_compressed_item_fails_the_load(local_s3, s3_prefix, make_writer, make_reader):
    state = {"w": _weights(2 * MiB)}
    dcp.save(state, storage_writer=make_writer(s3_prefix, compression="zstd"))
    item = _manifest(local_s3, s3_prefix).items[0].stored
    _flip_a_bit_in(local_s3, s3_prefix, item)
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(2 * MiB)}, storage_reader=make_reader(s3_prefix))
    assert isinstance(unwrap(info.value), CorruptCheckpointError)


class _RowsPlanner(DefaultLoadPlanner):
    """Loads only rows ``[lo, hi)`` of tensor ``w``, as a resharded load would."""

    def __init__(self, lo: int, hi: int, target: torch.Tensor) -> None:
        super().__init__()
        self.lo, self.hi, self.target = lo, hi, target

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata["w"]
        chunk = ChunkStorageMetadata(
            offsets=torch.Size([self.lo, 0]), sizes=torch.Size([self.hi - self.lo, md.size[1]])
        )
        return LoadPlan(create_read_items_for_chunk_list("w", md, [chunk]))

    def resolve_tensor(self, read_item):
        rows = read_item.dest_offsets[0]
        return self.target.narrow(0, rows, read_item.lengths[0])

    def commit_tensor(self, read_item, tensor) -> None:
        pass


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_row_range_is_fetched_and_decoded_alone(s3_prefix, make_writer, make_reader, compression):
    full = _weights(4096, 1024)  # 16 MiB: two checksum blocks of 8 MiB
    dcp.save({"w": full}, storage_writer=make_writer(s3_prefix, compression=compression))
    target = torch.zeros(1000, 1024)
    reader = make_reader(s3_prefix)
    dcp.load(
        {"w": torch.zeros(4096, 1024)},
        storage_reader=reader,
        planner=_RowsPlanner(2500, 3500, target),
    )
    assert torch.equal(target, full[2500:3500])


def _many_items() -> dict:
    """Many compressed items, one larger than the tight budget below, raw ones between."""
    state = {f"w{i:02d}": _weights(128, 1024, dtype=torch.bfloat16, seed=i) for i in range(40)}
    state["big"] = _weights(2048, 1024, dtype=torch.bfloat16, seed=99)  # 4 MiB
    state["noise"] = torch.randint(0, 256, (200_000,), dtype=torch.uint8)  # stored raw
    return state


@pytest.fixture
def tight_frames_budget(monkeypatch):
    """A 1 MiB budget for frames awaiting decoding (4 requests of 256 KiB), and its peak."""
    from s3ckpt.dcp import fetch
    from s3ckpt.transfer import download

    monkeypatch.setattr(fetch, "FRAMES_BUDGET", 0)
    peak = [0]
    enter = download._Admission.enter

    async def tracked(self, nbytes, *, wait=True):
        await enter(self, nbytes, wait=wait)
        peak[0] = max(peak[0], self.used)

    monkeypatch.setattr(download._Admission, "enter", tracked)
    return peak


@pytest.mark.timeout(120)
def test_a_load_under_a_tight_frames_budget_round_trips(
    s3_prefix, make_writer, make_reader, tight_frames_budget
):
    state = _many_items()
    dcp.save(state, storage_writer=make_writer(s3_prefix, compression="zstd"))
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, storage_reader=make_reader(s3_prefix, request_size=256 * 1024))
    for key, tensor in state.items():
        assert torch.equal(loaded[key], tensor), key
    # Bounded: the budget, plus the one item larger than it, admitted alone.
    assert 0 < tight_frames_budget[0] <= 1 * MiB + 4 * MiB


@pytest.mark.timeout(120)
def test_a_damaged_item_fails_a_load_under_a_tight_frames_budget(
    local_s3, s3_prefix, make_writer, make_reader, tight_frames_budget
):
    # The frames of a failed decode still go back, so the downloads waiting for the
    # budget finish and the load reports the damage instead of waiting forever.
    state = _many_items()
    dcp.save(state, storage_writer=make_writer(s3_prefix, compression="zstd"))
    item = next(i.stored for i in _manifest(local_s3, s3_prefix).items if i.stored.codec != "raw")
    _flip_a_bit_in(local_s3, s3_prefix, item)
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(BaseException) as info:
        dcp.load(loaded, storage_reader=make_reader(s3_prefix, request_size=256 * 1024))
    assert isinstance(unwrap(info.value), CorruptCheckpointError)
