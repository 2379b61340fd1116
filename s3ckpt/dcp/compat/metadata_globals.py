"""What a DCP ``Metadata`` pickle may name, derived from the running torch, and how
``TensorProperties`` grew between releases (a newer torch's pickle loads here too)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint.metadata as _metadata_module
from torch.distributed.checkpoint.metadata import TensorProperties

# (module, name) pairs, beyond torch's own dtypes, memory formats and layouts, that DCP's
# Metadata pickle may reference. ``_MEM_FORMAT_ENCODING`` is how TensorProperties pickles
# its memory format; ``torch.Size`` holds shapes and offsets.
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_OTHER_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {("torch", "Size"), ("torch.serialization", "_get_layout")}
    | {
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
    }
)
# torch's values that metadata names by ``torch.<name>``: each is data, never code.
_TORCH_VALUE_TYPES = (torch.dtype, torch.memory_format, torch.layout)


def metadata_global(module: str, name: str) -> object | None:
    """The object a DCP metadata pickle may name as ``module.name``; ``None`` if refused.

    Derived from the running torch rather than listed: every ``torch.dtype`` it defines
    (a new dtype such as ``float8_e8m0fnu`` is allowed the day torch adds it), its memory
    formats and layouts, and every class defined in DCP's ``metadata`` module (plain
    dataclasses and enums). :class:`TensorProperties` is read through
    :class:`_PortableTensorProperties`, so a newer torch's pickle loads here too.
    """
    if module == "torch":
        value = getattr(torch, name, None)
        if isinstance(value, _TORCH_VALUE_TYPES):
            return value
    if module == _METADATA_MODULE:
        value = getattr(_metadata_module, name, None)
        if isinstance(value, type) and value.__module__ == _METADATA_MODULE:
            return _PortableTensorProperties if value is TensorProperties else value
    if (module, name) in _OTHER_METADATA_GLOBALS:
        return _resolve(module, name)
    return None


def _resolve(module: str, name: str) -> object:
    import importlib

    return getattr(importlib.import_module(module), name)


_PROPERTIES_FIELDS = len(TensorProperties().__getstate__())


class _PortableTensorProperties(TensorProperties):
    """Unpickles the ``TensorProperties`` of any torch release into this one's class.

    torch 2.15 added ``strides`` and pickles six fields; 2.13's ``__setstate__`` takes
    exactly five. Fields this torch does not know (at the end of the tuple) are dropped,
    then the object becomes a plain :class:`TensorProperties`, indistinguishable from one
    this torch unpickled itself.
    """

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        TensorProperties.__setstate__(self, tuple(state[:_PROPERTIES_FIELDS]))
        self.__class__ = TensorProperties  # type: ignore[assignment]
