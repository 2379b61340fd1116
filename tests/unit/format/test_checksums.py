import asyncio
import os
import platform
import random

import pytest
import torch
from crc32c import crc32c
from ranged_bodies import PayloadRange

from s3ckpt.dcp.tensor_bytes import tensor_view
from s3ckpt.format import checksums
from s3ckpt.format.checksums import StreamingCheck, block_crcs, combine, range_crc
from s3ckpt.transfer.download import ReadTarget, _Scatter, plan_requests

MiB = 1024 * 1024


def _feed_in_chunks(check: StreamingCheck, data: bytes, chunk: int, start: int = 0) -> None:
    for lo in range(0, len(data), chunk):
        check.feed(start + lo, memoryview(data)[lo : lo + chunk])


def test_streaming_check_accepts_good_bytes_in_any_chunking():
    data = os.urandom(10_000)
    expected = block_crcs(memoryview(data), 1024)
    for chunk in (1, 7, 1000, 1024, 4096, 10_000):
        check = StreamingCheck(expected, 1024, 0, len(data))
        _feed_in_chunks(check, data, chunk)
        assert check.active and check.bad_block is None


def test_streaming_check_names_the_corrupted_block():
    data = bytearray(os.urandom(10_000))
    expected = block_crcs(memoryview(bytes(data)), 1024)
    data[5000] ^= 1
    check = StreamingCheck(expected, 1024, 0, len(data))
    _feed_in_chunks(check, bytes(data), 333)
    assert check.bad_block == 4


def test_blocks_may_arrive_in_any_order_but_bytes_within_a_block_may_not():
    data = os.urandom(4096)
    expected = block_crcs(memoryview(data), 1024)
    check = StreamingCheck(expected, 1024, 0, len(data))
    for block in (3, 1, 0, 2):
        check.feed(block * 1024, memoryview(data)[block * 1024 : (block + 1) * 1024])
    assert check.active and check.bad_block is None
    check = StreamingCheck(expected, 1024, 0, len(data))
    check.feed(512, memoryview(data)[512:1024])
    assert not check.active  # the caller will verify the whole buffer instead


def test_requests_are_cut_on_block_boundaries_and_verify_in_flight():
    data = os.urandom(50 * MiB + 123)
    block = 8 * MiB
    targets, buffers = [], []
    for start, end in ((0, 3 * MiB), (3 * MiB, 50 * MiB + 123)):
        item = memoryview(data)[start:end]
        check = StreamingCheck(block_crcs(item, block), block, 0, len(item))
        buffers.append(bytearray(end - start))
        targets.append(ReadTarget("k", start, end, memoryview(buffers[-1]), (start, end), check))
    requests = plan_requests(targets, max_request_size=16 * MiB)
    for request in requests:
        for target in request.targets:
            for edge in (max(request.start, target.start), min(request.end, target.end)):
                assert edge in (target.start, target.end) or (edge - target.start) % block == 0
    for request in reversed(requests):  # responses finishing in any order
        body = PayloadRange(data, request.start, request.end)
        asyncio.run(_Scatter(request, lambda t: None).receive(body))
    for target, buffer in zip(targets, buffers, strict=True):
        assert target.check.active and target.check.bad_block is None
        assert bytes(buffer) == data[target.start : target.end]


@pytest.mark.parametrize(
    "left,right", [(0, 0), (1, 0), (0, 5), (3, 7), (4096, 12345), (9 * MiB, 3)]
)
def test_combined_crcs_equal_the_crc_of_the_joined_bytes(left, right):
    a, b = os.urandom(left), os.urandom(right)
    assert combine(crc32c(a), crc32c(b), right) == crc32c(a + b)
    assert checksums._combine_python(crc32c(a), crc32c(b), right) == crc32c(a + b)


def test_the_native_combine_is_built_and_agrees_with_the_python_one():
    """Parts packed from small items combine a CRC per item; the C module does it without
    the 5-10 us of Python per call. It is built wherever the package is installed here."""
    assert checksums._native_combine is not None
    rng = random.Random(7)
    for _ in range(500):
        crc1, crc2 = rng.getrandbits(32), rng.getrandbits(32)
        length = rng.choice([0, 1, rng.randrange(1 << 20), rng.randrange(1 << 43)])
        assert combine(crc1, crc2, length) == checksums._combine_python(crc1, crc2, length)
    for combined in (combine, checksums._combine_python):
        with pytest.raises(ValueError, match="not negative"):
            combined(1, 2, -1)
        with pytest.raises(ValueError, match="32-bit"):
            combined(1 << 32, 2, 3)
    with pytest.raises(OverflowError):
        combine(-1, 2, 3)
    with pytest.raises(OverflowError):
        combine(1 << 64, 2, 3)


@pytest.mark.parametrize("combined", [combine, checksums._combine_python])
def test_combines_hold_for_pieces_of_512_mib_and_more(combined):
    """x^(2^k) modulo the Castagnoli polynomial repeats every 31 steps, not 32 as zlib's
    does: indexed as zlib indexes its own, the shift was wrong from 2^29 bytes on, which a
    part of 512 MiB or more packed after another item would have carried as its CRC32C.
    Checked against the CRC of the joined bytes (zero pages: cheap to read), and beyond
    what can be read, by the shifts multiplying: combining L1 then L2 bytes of zeros-CRC
    equals combining L1 + L2."""
    head = crc32c(b"an item before")
    for length in ((1 << 29) - 1, 1 << 29, (1 << 29) + 12345, 3 << 29):
        zeros = bytes(length)
        assert combined(head, crc32c(zeros), length) == crc32c(zeros, head), length
    rng = random.Random(11)
    for _ in range(200):
        first, second = rng.randrange(1 << 40), rng.randrange(1 << 40)
        crc = rng.getrandbits(32) or 1
        assert combined(combined(crc, 0, first), 0, second) == combined(crc, 0, first + second)


def test_range_crc_comes_from_whole_blocks_only():
    data = memoryview(os.urandom(3 * MiB + 77))
    block = MiB
    blocks = block_crcs(data, block)
    for start, end in ((0, len(data)), (MiB, 3 * MiB), (2 * MiB, len(data)), (3 * MiB, len(data))):
        assert range_crc(blocks, block, len(data), start, end) == crc32c(data[start:end])
    for start, end in ((5, MiB), (0, MiB + 1), (MiB, MiB), (0, len(data) + 1)):
        assert range_crc(blocks, block, len(data), start, end) is None


def _buffers(rng: random.Random, block: int) -> list:
    sizes = [0, 1, block - 1, block, block + 1, 3 * block, 3 * block + 7]
    sizes += [rng.randrange(1, 5 * block) for _ in range(20)]
    data = [os.urandom(size) for size in sizes]
    tensor = torch.arange(10_000, dtype=torch.float32)
    return data + [memoryview(d) for d in data[:5]] + [tensor_view(tensor[123:9_000])]


@pytest.mark.parametrize("block", [1, 64, 1000, 8192])
def test_block_crcs_of_each_agrees_with_one_crc_per_block(block):
    """Many buffers' block CRC32Cs in one native pass (the GIL released once for all of
    them) give what one CRC32C per block gives, empty buffers included (one CRC, of no
    bytes), in the native module and in the Python fallback."""
    if platform.machine() in ("x86_64", "AMD64"):  # the native CRC32C's platforms
        assert checksums._native_block_crcs is not None
    datas = _buffers(random.Random(block), block)
    expected = [
        tuple(crc32c(bytes(d)[i : i + block]) for i in range(0, len(d), block)) or (crc32c(b""),)
        for d in datas
    ]
    assert checksums.block_crcs_of_each(datas, block) == expected
    assert [checksums._block_crcs_python(d, block) for d in datas] == expected
    assert [block_crcs(d, block) for d in datas] == expected
    assert checksums.block_crcs_of_each([], block) == []


def test_block_crcs_of_each_refuses_what_it_cannot_read():
    strided = memoryview(bytes(range(100)))[::2]
    with pytest.raises(ValueError, match="positive"):
        checksums.block_crcs_of_each([b"abc"], 0)
    with pytest.raises(ValueError, match="positive"):
        checksums._block_crcs_python(memoryview(b"abc"), 0)
    with pytest.raises(BufferError):
        checksums.block_crcs_of_each([b"ok", strided], 8)
    with pytest.raises(TypeError):
        checksums.block_crcs_of_each([b"ok", memoryview(b"ok"), 3], 8)
