import itertools
import os

import pytest
import torch

from s3ckpt.dcp.tensor_bytes import tensor_view
from s3ckpt.errors import ConfigError, CorruptCheckpointError
from s3ckpt.format import compression
from s3ckpt.format.checksums import block_crcs
from s3ckpt.format.compression import (
    RAW,
    ZSTD,
    ZSTD_GROUPED,
    Compression,
    Compressor,
    RawRuns,
    decode_block,
    encode,
)

BLOCK = 1 << 16


def _weights(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Trained-weight-like values: small, normally distributed (low-entropy exponents)."""
    return (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)


def _decode_all(encoded, raw_length: int) -> bytes:
    out = bytearray(raw_length)
    view, position = memoryview(out), 0
    for n, size in enumerate(encoded.frames):
        start = n * BLOCK
        decode_block(
            encoded.payload[position : position + size], encoded.codec, view[start : start + BLOCK]
        )
        position += size
    return bytes(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_float_items_are_byte_grouped_and_round_trip(dtype):
    tensor = _weights(100_003, dtype)
    data = tensor_view(tensor)
    encoded = encode(data, dtype.itemsize, Compression(), BLOCK)
    assert encoded.codec == ZSTD_GROUPED
    assert len(encoded.frames) == -(-len(data) // BLOCK)
    assert sum(encoded.frames) < 0.9 * len(data)
    assert _decode_all(encoded, len(data)) == bytes(data)


def test_byte_grouping_beats_plain_zstd_on_bf16_weights():
    data = tensor_view(_weights(1 << 20, torch.bfloat16))
    grouped = encode(data, 2, Compression(), BLOCK)
    plain = encode(data, 0, Compression(), BLOCK)
    assert plain.codec == ZSTD
    assert sum(grouped.frames) / len(data) < sum(plain.frames) / len(data) - 0.05


def test_incompressible_items_are_stored_raw():
    data = memoryview(torch.randint(0, 256, (300_000,), dtype=torch.uint8).numpy())
    encoded = encode(data, 0, Compression(), BLOCK)
    assert encoded.codec == RAW
    assert encoded.payload == data
    assert encoded.frames == ()


def test_integers_use_plain_zstd():
    data = tensor_view(torch.zeros(50_000, dtype=torch.int64))
    encoded = encode(data, 0, Compression(), BLOCK)
    assert encoded.codec == ZSTD
    assert _decode_all(encoded, len(data)) == bytes(data)


def test_a_damaged_frame_is_a_corrupt_checkpoint():
    data = tensor_view(_weights(BLOCK // 2, torch.bfloat16))
    encoded = encode(data, 2, Compression(), BLOCK)
    frame = bytearray(encoded.payload[: encoded.frames[0]])
    frame[len(frame) // 2] ^= 0xFF
    frame[6] ^= 0xFF  # a plane length in the header
    with pytest.raises(CorruptCheckpointError):
        decode_block(memoryview(bytes(frame)), ZSTD_GROUPED, memoryview(bytearray(len(data))))


def test_the_compressor_keeps_order_under_a_tight_budget():
    """Results come out in submission order, and an item waits (``full``) while it would
    take the raw bytes pending past ``max_ahead``, unless nothing is pending."""
    items = [(i, tensor_view(_weights(10_000 + i, torch.float32)), 4) for i in range(12)]
    options = Compression(threads=3, max_ahead=50_000)
    results = []
    with Compressor[int](options, BLOCK) as compressor:
        assert not compressor.full(options.max_ahead + 1)  # an empty pipeline takes any item
        for key, data, grouping in items:
            while compressor.full(len(data)):
                results.append(compressor.take())
            pending = sum(len(d) for k, d, _ in items[len(results) : key])
            assert pending + len(data) <= options.max_ahead or compressor.pending == 0
            compressor.submit(key, data, grouping)
        while compressor.pending:
            results.append(compressor.take())
    assert [key for key, _ in results] == list(range(12))
    for (_, data, _), (_, encoded) in zip(items, results, strict=True):
        assert _decode_all(encoded, len(data)) == bytes(data)


def test_options_are_validated():
    assert Compression.parse(None) is None and Compression.parse("none") is None
    assert Compression.parse("zstd", 3) == Compression(level=3)
    with pytest.raises(ConfigError):
        Compression.parse("lz4")
    with pytest.raises(ConfigError):
        Compression(level=99)


@pytest.mark.parametrize("grouping", [0, 2, 4])
def test_decoding_a_block_returns_its_crc32c(grouping):
    # A load checks each decoded block against the manifest with this value.
    dtype = {0: torch.float32, 2: torch.bfloat16, 4: torch.float32}[grouping]
    data = tensor_view(_weights(3 * BLOCK // dtype.itemsize + 11, dtype))
    encoded = encode(data, grouping, Compression(), BLOCK)
    assert encoded.codec == (ZSTD_GROUPED if grouping else ZSTD)
    assert encoded.crc32c == block_crcs(data, BLOCK)
    out, position = memoryview(bytearray(len(data))), 0
    for n, size in enumerate(encoded.frames):
        block = out[n * BLOCK : (n + 1) * BLOCK]
        crc = decode_block(encoded.payload[position : position + size], encoded.codec, block)
        assert crc == encoded.crc32c[n]
        position += size
    assert bytes(out) == bytes(data)


def test_raw_items_are_checksummed_a_run_at_a_time(monkeypatch):
    """Small items are checksummed a run of RUN_BYTES at a time (one native pass, one GIL
    hand-over), taken once add() says their run is full (so the caller resolves items no
    further ahead than their run), and come out in order, each with the block CRC32Cs encode_raw
    gives it alone."""
    calls = []
    counted = compression.block_crcs_of_each

    def counting(datas, block_size):
        calls.append(len(datas))
        return counted(datas, block_size)

    monkeypatch.setattr(compression, "block_crcs_of_each", counting)
    small = compression.RUN_BYTES // 40
    items = [(n, memoryview(os.urandom(small if n % 9 else 3 * BLOCK + 5))) for n in range(100)]
    runs: RawRuns[int] = RawRuns(BLOCK)
    encoded, full_at = [], []
    for added, (key, data) in enumerate(items, 1):
        if runs.add(key, data):
            full_at.append(added)
            encoded.extend(runs.take())
    encoded.extend(runs.take())
    sizes = itertools.accumulate(len(data) for _, data in items)
    first_run = next(n for n, size in enumerate(sizes, 1) if size >= compression.RUN_BYTES)
    assert encoded[0][0] == 0 and full_at[0] == calls[0] == first_run
    assert [key for key, _ in encoded] == list(range(100))
    for (_, data), (_, result) in zip(items, encoded, strict=True):
        alone = compression.encode_raw(data, BLOCK)
        assert result.crc32c == alone.crc32c and result.codec == RAW and result.payload == data
    assert sum(calls) == 100 and len(calls) < 100 // 5
    assert list(RawRuns(BLOCK).take()) == []
