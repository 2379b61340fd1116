"""A held copy read into the model: bytes straight from the files, each region checked as
it lands; what cannot be read that way copied from the mapping and checked after."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from crc32c import crc32c

from s3ckpt.background import held
from s3ckpt.tier.copy_in import CheckedCopyIn

SEGMENT = 1 << 16


def held_copy(slot: Path, regions: list[tuple[int, int]]) -> tuple[held.HeldRecord, bytes]:
    """A copy in ``slot``: one segment of random floats, ``regions`` as (offset, nbytes)."""
    data = torch.randn(SEGMENT // 4).numpy().tobytes()  # floats, no NaN
    (slot / "segment-0").write_bytes(data)
    record = held.HeldRecord(
        step=1, rank=0, world=1, run="s3://b/r", segments=(SEGMENT,),
        regions=tuple(held.HeldRegion(0, o, n, crc32c(data[o : o + n])) for o, n in regions),
        state_crc32c=crc32c(b"state"), nbytes=sum(n for _, n in regions), created=time.time(),
    )  # fmt: skip
    held.write(slot, record, b"state")
    return record, data


def floats(copy: held.MappedCopy, offset: int, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(copy.maps[0], dtype=torch.float32, count=nbytes // 4, offset=offset)


def test_regions_are_read_whole_however_the_pieces_fall(tmp_path, monkeypatch):
    monkeypatch.setattr(held, "_PIECE", 1000)
    monkeypatch.setattr(held, "_READ_PIECE", 300)
    record, data = held_copy(tmp_path, [(0, 4096), (4096, 3001), (8192, 0), (9000, 20000)])
    copy = held.MappedCopy(tmp_path, record)
    try:
        targets = [bytearray(r.nbytes) for r in record.regions]
        reads = [(r, memoryview(t)) for r, t in zip(record.regions, targets, strict=True)]
        assert copy.read_checked(reads) == []
        for region, target in zip(record.regions, targets, strict=True):
            assert bytes(target) == data[region.offset : region.offset + region.nbytes]
    finally:
        copy.close()


def test_whole_regions_are_read_from_the_files_the_rest_from_the_mapping(tmp_path):
    record, _ = held_copy(tmp_path, [(0, 4096), (4096, 8192), (16384, 1024)])
    copy = held.MappedCopy(tmp_path, record)
    try:
        copy_in = CheckedCopyIn(copy)
        whole = floats(copy, 0, 4096)
        matrix = floats(copy, 4096, 8192).view(32, 64)
        other = floats(copy, 16384, 1024)
        targets = [
            torch.zeros(1024),
            torch.zeros(64, 32).t(),
            torch.zeros(256, dtype=torch.float64),
        ]
        copy_in([(whole, targets[0]), (matrix, targets[1]), (other, targets[2])])
        assert copy_in.checked == {record.regions[0]}  # the others: not laid out the same
        assert torch.equal(targets[0], whole)
        assert torch.equal(targets[1], matrix)
        assert torch.equal(targets[2], other.double())
        assert copy_in.problem() is None  # the rest checked through the mapping
    finally:
        copy.close()


@pytest.mark.parametrize("where", [100, 4096 + 5000])  # a region read whole, one that is not
def test_damage_is_found_wherever_the_bytes_were_read(tmp_path, where):
    record, data = held_copy(tmp_path, [(0, 4096), (4096, 8192)])
    damaged = bytearray(data)
    damaged[where] ^= 0x10
    (tmp_path / "segment-0").write_bytes(damaged)
    copy = held.MappedCopy(tmp_path, record)
    try:
        copy_in = CheckedCopyIn(copy)
        targets = [torch.zeros(1024), torch.zeros(64, 32).t()]
        sources = [floats(copy, 0, 4096), floats(copy, 4096, 8192).view(32, 64)]
        copy_in(list(zip(sources, targets, strict=True)))
        problem = copy_in.problem()
        span = "bytes 0..4096" if where < 4096 else "bytes 4096..12288"
        assert problem is not None and "segment-0" in problem and span in problem
    finally:
        copy.close()


def test_a_damaged_state_is_found_before_anything_is_read(tmp_path):
    record, _ = held_copy(tmp_path, [(0, 4096)])
    (tmp_path / held.STATE).write_bytes(b"stale")
    copy = held.MappedCopy(tmp_path, record)
    try:
        assert "state.pkl does not match" in (copy.state_problem() or "")
        assert "state.pkl does not match" in (copy.verify() or "")
    finally:
        copy.close()


def test_a_resharding_load_checks_only_the_regions_it_read_from(tmp_path):
    # regions: 0..4096, 4096..12288 (a 32x64 matrix), 16384..17408; a gap before the last
    record, data = held_copy(tmp_path, [(0, 4096), (4096, 8192), (16384, 1024)])
    damaged = bytearray(data)
    damaged[16384 + 10] ^= 0x10  # in the region the load never reads
    (tmp_path / "segment-0").write_bytes(damaged)
    copy = held.MappedCopy(tmp_path, record)
    try:
        copy_in = CheckedCopyIn(copy, whole=False)
        rows = floats(copy, 4096, 8192).view(32, 64)[8:12]  # a slice of the matrix
        cols = floats(copy, 4096, 8192).view(32, 64)[:, 3:5]  # strided, spans it all
        first = floats(copy, 0, 4096)[10:20]
        targets = [torch.zeros(4, 64), torch.zeros(32, 2), torch.zeros(10)]
        copy_in(list(zip([rows, cols, first], targets, strict=True)))
        assert copy_in.touched == {record.regions[0], record.regions[1]}
        assert torch.equal(targets[0], rows) and torch.equal(targets[1], cols)
        assert copy_in.problem() is None  # the damaged region was not read
        assert CheckedCopyIn(copy).problem() is not None  # checked whole, it is found
    finally:
        copy.close()
    # damage in a region it read part of is found
    damaged[16384 + 10] ^= 0x10
    damaged[4096 + 64 * 4 * 31] ^= 0x10  # the matrix's last row: not in the rows read
    (tmp_path / "segment-0").write_bytes(damaged)
    copy = held.MappedCopy(tmp_path, record)
    try:
        copy_in = CheckedCopyIn(copy, whole=False)
        copy_in([(floats(copy, 4096, 8192).view(32, 64)[8:12], torch.zeros(4, 64))])
        problem = copy_in.problem()
        assert problem is not None and "bytes 4096..12288" in problem
    finally:
        copy.close()
