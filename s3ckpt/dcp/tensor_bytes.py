"""Tensor bytes in and out, and their CRC32C checksums, without copying.

Tensors are stored raw: their contiguous little-endian bytes, no ``torch.save`` and no
pickle per tensor. On save a CPU tensor is exposed as a ``memoryview`` over its own
storage (a copy happens only for GPU or non-contiguous tensors, which must be gathered
anyway); on load bytes land in a ``uint8`` buffer that is reinterpreted in place as the
target dtype and shape. Checksums live in :mod:`s3ckpt.format.checksums`.

A save in thread mode reaches every tensor from a thread beside the training loop, and
every torch method call there releases the GIL and takes it back (``detach``,
``is_conj``, ``is_neg``, ``reshape``, ``view``, ``numpy``); each retake waits for the loop
to let the GIL go and makes the loop wait in turn (docs/decisions/0008-thread-mode-gil.md).
So the common case, a CPU tensor that is contiguous and has no lazy conjugate or negative
bit, is checked and viewed by reading attributes (``is_cpu``, ``is_contiguous``, the
dispatch keys, ``data_ptr``, ``nbytes``), which release nothing.
"""

from __future__ import annotations

import ctypes
import sys

import torch

from s3ckpt.dcp.compat import has_lazy_bits

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("s3ckpt stores raw little-endian tensor bytes and needs a little-endian host")

_BYTE_DTYPES = {torch.uint8, torch.int8, torch.bool}


def as_cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU, contiguous and dense (copied only when it must be)."""
    if tensor.is_cpu and tensor.is_contiguous() and not has_lazy_bits(tensor):
        return tensor
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
    """A writable byte ``memoryview`` over a CPU contiguous tensor's elements (zero-copy).

    Made over the tensor's address, not through torch views and numpy (see the module's
    docstring); the view holds the tensor, so the memory lives as long as it does."""
    nbytes = tensor.nbytes
    if nbytes == 0:
        return memoryview(bytearray())
    window = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    window._tensor = tensor  # type: ignore[attr-defined]  # keeps the memory alive
    return memoryview(window).cast("B")


def tensor_from_bytes(
    buffer: torch.Tensor, dtype: torch.dtype, shape: torch.Size | tuple[int, ...]
) -> torch.Tensor:
    """Reinterpret a ``uint8`` buffer as a tensor of ``dtype`` and ``shape`` (zero-copy)."""
    if buffer.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    return buffer.view(dtype).reshape(shape)


def byte_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)
