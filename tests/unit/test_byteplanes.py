"""Byte planes: the C module and the numpy fallback agree, with each other and with the
definition (plane p holds byte p of every element)."""

import numpy as np
import pytest

from s3ckpt import byteplanes

IMPLEMENTATIONS = ["native", "numpy"]


@pytest.fixture(params=IMPLEMENTATIONS)
def planes_impl(request, monkeypatch):
    """Runs a test once through the C module and once through the numpy fallback."""
    if request.param == "numpy":
        monkeypatch.setattr(byteplanes, "_native", None)
    return request.param


def test_the_c_module_is_built():
    # pip install -e . builds it wherever a C compiler exists, as on every test machine.
    assert byteplanes.NATIVE


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
