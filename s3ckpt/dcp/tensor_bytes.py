"""Tensor bytes in and out, and their CRC32C checksums, without copying.

Tensors are stored raw: their contiguous little-endian bytes, no ``torch.save`` and no
pickle per tensor. On save a CPU tensor is exposed as a ``memoryview`` over its own
storage (a copy happens only for GPU or non-contiguous tensors, which must be gathered
anyway); on load bytes land in a ``uint8`` buffer that is reinterpreted in place as the
target dtype and shape. Checksums live in :mod:`s3ckpt.format.checksums`.
"""

from __future__ import annotations

import sys

import torch

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("s3ckpt stores raw little-endian tensor bytes and needs a little-endian host")

_BYTE_DTYPES = {torch.uint8, torch.int8, torch.bool}


def as_cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU, contiguous and dense (copied only when it must be)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor


def tensor_view(tensor: torch.Tensor) -> memoryview:
    """A byte ``memoryview`` over a CPU contiguous tensor's elements (zero-copy)."""
    if tensor.numel() == 0:
        return memoryview(bytearray())
    flat = tensor.reshape(-1)
    raw = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    return memoryview(raw.numpy()).cast("B")


def tensor_from_bytes(
    buffer: torch.Tensor, dtype: torch.dtype, shape: torch.Size | tuple[int, ...]
) -> torch.Tensor:
    """Reinterpret a ``uint8`` buffer as a tensor of ``dtype`` and ``shape`` (zero-copy)."""
    if buffer.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    return buffer.view(dtype).reshape(shape)


def byte_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)
