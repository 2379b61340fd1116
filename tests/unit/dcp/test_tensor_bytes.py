import pytest
import torch

from s3ckpt.dcp.tensor_bytes import (
    as_cpu_contiguous,
    byte_buffer,
    tensor_from_bytes,
    tensor_view,
)
from s3ckpt.errors import CorruptCheckpointError
from s3ckpt.format.checksums import block_crcs, verify_blocks

DTYPES = [
    torch.bfloat16, torch.float16, torch.float32, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
    torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip


def _sample(dtype, shape):
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5, 2)])
def test_bytes_round_trip_bit_exact(dtype, shape):
    original = _sample(dtype, shape)
    data = tensor_view(as_cpu_contiguous(original))
    assert len(data) == original.numel() * original.element_size()
    buffer = byte_buffer(len(data))
    tensor_view(buffer)[:] = data
    restored = tensor_from_bytes(buffer, dtype, shape)
    assert restored.shape == original.shape
    assert restored.dtype == dtype
    assert bytes(tensor_view(restored)) == bytes(data)


def test_tensor_view_shares_memory_with_the_tensor():
    tensor = torch.zeros(4, dtype=torch.float32)
    view = tensor_view(tensor)
    tensor[0] = 1.0
    assert bytes(view[:4]) == torch.tensor([1.0]).numpy().tobytes()


def test_non_contiguous_tensors_are_gathered():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    transposed = base.t()
    assert not transposed.is_contiguous()
    data = tensor_view(as_cpu_contiguous(transposed))
    restored = tensor_from_bytes(
        torch.frombuffer(bytearray(data), dtype=torch.uint8), torch.float32, (4, 3)
    )
    assert torch.equal(restored, transposed)


def test_block_crcs_detect_a_flipped_byte_and_name_the_block():
    data = bytearray(range(256)) * 100
    crcs = block_crcs(memoryview(data), 1000)
    assert len(crcs) == 26
    verify_blocks(memoryview(data), crcs, block_size=1000, first_block=0, what="item")
    verify_blocks(memoryview(data)[3000:5000], crcs, block_size=1000, first_block=3, what="item")
    data[4321] ^= 0x01
    with pytest.raises(CorruptCheckpointError, match="block 4"):
        verify_blocks(memoryview(data), crcs, block_size=1000, first_block=0, what="item 'w'")


def test_empty_items_have_a_checksum_too():
    crcs = block_crcs(memoryview(b""), 1000)
    verify_blocks(memoryview(b""), crcs, block_size=1000, first_block=0, what="empty")


def test_lazy_conjugate_and_negative_bits_are_resolved_before_the_bytes_are_read():
    values = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    negative_imag = values.conj().imag.detach()  # a negative bit on a tensor that is no view
    for lazy, expected in [
        (values.conj(), values.conj().resolve_conj()),
        (negative_imag, torch.tensor([-2.0, 4.0])),
        (torch._neg_view(torch.tensor([5.0, 6.0])), torch.tensor([-5.0, -6.0])),
    ]:
        assert lazy.is_conj() or lazy.is_neg()
        data = bytes(tensor_view(as_cpu_contiguous(lazy)))
        assert data == bytes(tensor_view(expected.contiguous()))


def test_plain_cpu_tensors_are_viewed_in_place_and_kept_alive_by_their_view():
    from s3ckpt.dcp.compat import has_lazy_bits

    tensor = torch.arange(6, dtype=torch.float32)
    assert as_cpu_contiguous(tensor) is tensor
    assert not has_lazy_bits(tensor) and not has_lazy_bits(tensor[1:])
    view = tensor_view(tensor[2:])  # a view's bytes start at its own offset
    assert bytes(view) == torch.tensor([2.0, 3.0, 4.0, 5.0]).numpy().tobytes()
    del tensor
    import gc

    gc.collect()
    assert bytes(view[:4]) == torch.tensor([2.0]).numpy().tobytes()
    assert not view.readonly
