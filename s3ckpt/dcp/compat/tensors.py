"""Tensor-level torch details: a tensor subclass that behaves as a plain tensor, lazy
conjugate and negative bits read without the GIL's release, page-locking host memory
for CUDA, and the bytes and views of write items and chunks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem

# A tensor subclass with this as its ``__torch_function__`` behaves as a plain tensor
# under torch functions (torch's own default for subclasses, ``torch._C``'s).
disabled_torch_function = torch._C._disabled_torch_function_impl


def tensor_subclass_of(cls: type, data: torch.Tensor) -> Any:
    """``data`` seen as an instance of the ``torch.Tensor`` subclass ``cls``, sharing its
    memory (torch's private ``Tensor._make_subclass``)."""
    return torch.Tensor._make_subclass(cls, data)


_LAZY_KEYS = tuple(
    getattr(torch._C.DispatchKey, name)
    for name in ("Conjugate", "Negative")
    if hasattr(torch._C, "DispatchKey") and hasattr(torch._C.DispatchKey, name)
)


def has_lazy_bits(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` carries a lazy conjugate or negative bit (its bytes are not its
    values). Read from its dispatch keys (torch's private ``_dispatch_keys``), which,
    unlike ``is_conj()`` and ``is_neg()``, does not release and retake the GIL."""
    keys_of = getattr(torch._C, "_dispatch_keys", None)
    if keys_of is None or len(_LAZY_KEYS) != 2:
        return tensor.is_conj() or tensor.is_neg()
    keys = keys_of(tensor)
    return keys.has(_LAZY_KEYS[0]) or keys.has(_LAZY_KEYS[1])


def pin_host_memory(tensor: torch.Tensor) -> bool:
    """Page-lock the host memory under ``tensor`` for CUDA (``cudaHostRegister``), so that
    device-to-host copies into it run without a bounce and without blocking; False where
    there is no CUDA (or it refuses)."""
    if not torch.cuda.is_available() or tensor.numel() == 0:
        return False
    status = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    return int(status) == 0


def unpin_host_memory(tensor: torch.Tensor) -> None:
    """Undo :func:`pin_host_memory`."""
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


def item_nbytes(item: WriteItem) -> int:
    """Bytes a tensor write item (a whole tensor or one shard) will occupy."""
    assert item.tensor_data is not None
    numel = 1
    for size in item.tensor_data.chunk.sizes:
        numel *= size
    return numel * item.tensor_data.properties.dtype.itemsize


def narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The sub-tensor at ``offsets`` with ``lengths`` (a view)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor
