"""Byte planes: the C module and the numpy fallback agree, with each other and with the
definition (plane p holds byte p of every element), and the fused checksums are CRC32C."""

import numpy as np
import pytest
from crc32c import crc32c

from s3ckpt.format import byteplanes

IMPLEMENTATIONS = ["native", "native-separate-crc", "numpy"]


@pytest.fixture(params=IMPLEMENTATIONS)
def planes_impl(request, monkeypatch):
    """Runs a test through the C module with and without its fused CRC32C, and through
    the numpy fallback."""
    if request.param == "numpy":
        monkeypatch.setattr(byteplanes, "_native", None)
    if request.param == "native-separate-crc":
        monkeypatch.setattr(byteplanes, "FUSED_CRC", False)
    return request.param


def test_the_c_module_is_built():
    # pip install -e . builds it wherever a C compiler exists, as on every test machine.
    assert byteplanes.NATIVE


@pytest.mark.skipif(
    __import__("platform").machine() not in ("x86_64", "AMD64"), reason="SSE4.2 is x86-64"
)
def test_the_fused_checksum_is_available_on_x86_64():
    assert byteplanes.FUSED_CRC


@pytest.mark.parametrize("itemsize", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("count", [0, 1, 7, 4099])
def test_split_and_merge_are_inverse(planes_impl, itemsize, count):
    data = np.random.default_rng(itemsize * 10_000 + count).integers(
        0, 256, itemsize * count, dtype=np.uint8
    )
    grouped = byteplanes.split(memoryview(data), itemsize)
    expected = np.concatenate([data[p::itemsize] for p in range(itemsize)])
    assert bytes(grouped) == expected.tobytes()

    planes = [grouped[p * count : (p + 1) * count] for p in range(itemsize)]
    out = bytearray(len(data))
    byteplanes.merge(planes, memoryview(out))
    assert bytes(out) == data.tobytes()


def test_merge_takes_any_buffers(planes_impl):
    out = bytearray(6)
    byteplanes.merge([b"abc", bytearray(b"ABC")], memoryview(out))
    assert bytes(out) == b"aAbBcC"
    target = np.zeros(6, dtype=np.uint8)
    byteplanes.merge((memoryview(b"abc"), np.frombuffer(b"ABC", dtype=np.uint8)), target)
    assert target.tobytes() == b"aAbBcC"


def test_bad_shapes_are_value_errors(planes_impl):
    with pytest.raises(ValueError):
        byteplanes.split(b"abc", 2)  # not whole elements
    with pytest.raises(ValueError):
        byteplanes.merge([b"ab", b"a"], memoryview(bytearray(4)))  # planes of unequal length
    with pytest.raises(ValueError):
        byteplanes.merge([b"ab", b"ab"], memoryview(bytearray(5)))  # output not whole elements
    with pytest.raises(ValueError):
        byteplanes.merge([], memoryview(bytearray(4)))


def test_the_c_module_refuses_read_only_output():
    with pytest.raises(TypeError):
        byteplanes.merge([b"ab", b"cd"], memoryview(b"xxxx"))


# Counts around the fused kernel's boundaries: its 3 x 4096-element runs, the 8192-element
# chunks of other sizes, and the 256 KiB output above which bf16 goes around the cache.
FUSED_COUNTS = [0, 1, 15, 12_287, 12_288, 12_289, 8192 * 3 + 5, 131_071, 131_072, 300_007]


@pytest.mark.parametrize("itemsize", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("count", FUSED_COUNTS)
def test_split_crc_and_merge_crc_return_crc32c_of_the_elements(planes_impl, itemsize, count):
    rng = np.random.default_rng(itemsize * 1_000_003 + count)
    data = rng.integers(0, 256, itemsize * count, dtype=np.uint8)
    start = int(rng.integers(0, 2**32))
    grouped, crc = byteplanes.split_crc(memoryview(data), itemsize, start)
    assert crc == crc32c(data, start)
    assert bytes(grouped) == bytes(byteplanes.split(memoryview(data), itemsize))

    planes = [grouped[p * count : (p + 1) * count] for p in range(itemsize)]
    out = np.zeros(len(data), dtype=np.uint8)
    assert byteplanes.merge_crc(planes, out, start) == crc32c(data, start)
    assert np.array_equal(out, data)


@pytest.mark.parametrize("misalign", [1, 2, 6, 14])
def test_merge_crc_handles_unaligned_output(planes_impl, misalign):
    # A block of a destination tensor need not start on a 16-byte boundary.
    count = 200_003
    data = np.random.default_rng(misalign).integers(0, 256, 2 * count, dtype=np.uint8)
    lo, hi = data[0::2].copy(), data[1::2].copy()
    backing = np.zeros(2 * count + misalign, dtype=np.uint8)
    out = backing[misalign:]
    assert byteplanes.merge_crc([lo, hi], out) == crc32c(data)
    assert np.array_equal(out, data)
    assert not backing[:misalign].any()


def test_merge_crc_refuses_what_merge_refuses(planes_impl):
    with pytest.raises(ValueError):
        byteplanes.merge_crc([b"ab", b"a"], memoryview(bytearray(4)))
    with pytest.raises(ValueError):
        byteplanes.split_crc(b"abc", 2)
