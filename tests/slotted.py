"""A holder of a tensor without ``__dict__``, as ``ShardedTensor``'s shards hold their data:
tensors that a walk of dicts and attributes does not find (the stagers' tests)."""

from __future__ import annotations

import torch


class Slotted:
    """One tensor in a slot."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
