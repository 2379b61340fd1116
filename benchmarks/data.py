"""The benchmark state dict: deterministic, mixed fp32/bf16, shaped like a real model.

About 60% of the bytes sit in a few large tensors (embeddings, big projections), 35% in
medium ones (layer weights) and 5% in many small ones (norms, biases), which is what makes
packing and coalescing matter. Values are random: they are not compressible, which is
right for measuring transfers.
"""

from __future__ import annotations

import statistics
import time

import torch

MiB = 1024 * 1024


def _tensor(nbytes: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    numel = max(1, nbytes // dtype.itemsize)
    return torch.randn(numel, generator=generator, dtype=torch.float32).to(dtype)


def make_state(total_mib: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict of about ``total_mib`` MiB."""
    generator = torch.Generator().manual_seed(seed)
    total = total_mib * MiB
    state: dict[str, torch.Tensor] = {}
    large = int(total * 0.60) // 4
    for i in range(4):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        state[f"large.{i}"] = _tensor(large, dtype, generator)
    medium_count = 64
    medium = int(total * 0.35) // medium_count
    for i in range(medium_count):
        dtype = torch.bfloat16 if i % 3 == 0 else torch.float32
        state[f"layers.{i}.weight"] = _tensor(medium, dtype, generator)
    small_count = 512
    small = int(total * 0.05) // small_count
    for i in range(small_count):
        state[f"layers.{i % medium_count}.norm{i}"] = _tensor(small, torch.float32, generator)
    return state


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def empty_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Destination tensors, already touched: a model being restored owns its memory."""
    return {k: torch.zeros_like(v) for k, v in state.items()}


class BareCopy:
    """The floor a save's blocking is measured against: copying the state into buffers
    allocated beforehand, their pages touched by a first copy. Kept to time the copy
    again beside each save: the host's memory bandwidth moves by 10 % and more over a
    minute here (the same 1 GiB copy 75-87 ms), more than a save adds to it."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state
        self.buffers = {k: torch.empty_like(v) for k, v in state.items()}
        self.time()

    def time(self) -> float:
        """Seconds one copy of the whole state takes."""
        started = time.perf_counter()
        for key, tensor in self.state.items():
            self.buffers[key].copy_(tensor)
        return time.perf_counter() - started


def bare_copy_s(state: dict[str, torch.Tensor], reps: int = 3) -> float:
    """:class:`BareCopy`'s time, the median of ``reps`` copies."""
    floor = BareCopy(state)
    return statistics.median(floor.time() for _ in range(reps))
