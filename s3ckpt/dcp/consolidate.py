"""Whole tensors out of a DCP checkpoint of any world size, a bounded batch at a time.

Export (:mod:`s3ckpt.interop.export`) must not hold a 70B model in memory to write it out.
DCP already knows how to reshard: asked to load into full-size tensors, its planner reads
every stored chunk (of however many ranks) into the right slice. So the checkpoint's
tensors are listed from DCP's ``Metadata`` and loaded with ``dcp.load`` into freshly
allocated full-size tensors a few at a time (:func:`batches`), on this process alone
(``no_dist``), while the caller writes out and drops the previous batch. Peak memory is
one batch (at least the largest tensor) plus the reader's in-flight buffers.

The storage reader can be any DCP ``StorageReader``: :class:`~s3ckpt.dcp.reader.S3StorageReader`
for export, DCP's ``FileSystemReader`` for importing a DCP folder.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp

from s3ckpt.dcp.compat import (
    BytesStorageMetadata,
    Metadata,
    StorageReader,
    TensorStorageMetadata,
    single_process,
)
from s3ckpt.dcp.load_report import reading_part


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checkpoint: its flattened name (FQN), dtype and full shape."""

    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Contents:
    """What a checkpoint holds: its tensors, and the FQNs of its non-tensor items."""

    tensors: tuple[StoredTensor, ...]
    others: tuple[str, ...]


def contents(metadata: Metadata) -> Contents:
    """The tensors and other items DCP's ``metadata`` lists, tensors in FQN order."""
    tensors, others = [], []
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            shape = tuple(int(s) for s in item.size)
            tensors.append(StoredTensor(fqn, item.properties.dtype, shape))
        elif isinstance(item, BytesStorageMetadata):
            others.append(fqn)
    return Contents(tuple(sorted(tensors, key=lambda t: t.fqn)), tuple(sorted(others)))


def read_contents(reader: StorageReader) -> Contents:
    """:func:`contents` of the checkpoint ``reader`` points at (reads its metadata)."""
    return contents(reader.read_metadata())


def batches(tensors: Sequence[StoredTensor], window: int) -> Iterator[tuple[StoredTensor, ...]]:
    """Consecutive runs of ``tensors`` of at most ``window`` bytes (a larger tensor alone)."""
    batch: list[StoredTensor] = []
    used = 0
    for tensor in tensors:
        if batch and used + tensor.nbytes > window:
            yield tuple(batch)
            batch, used = [], 0
        batch.append(tensor)
        used += tensor.nbytes
    if batch:
        yield tuple(batch)


def load_full(
    reader: Callable[[], StorageReader], tensors: Sequence[StoredTensor]
) -> dict[str, torch.Tensor]:
    """``tensors`` loaded whole, each resharded from however many chunks it was saved in.

    ``reader`` makes a fresh storage reader (one ``dcp.load`` each).
    """
    state = {t.fqn: torch.empty(t.shape, dtype=t.dtype) for t in tensors}
    with single_process(), reading_part():  # a window: the rest is left out on purpose
        dcp.load(state, storage_reader=reader(), no_dist=True)
    return state


def load_all(reader: Callable[[], StorageReader], found: Contents) -> dict[str, object]:
    """Every item of a checkpoint at once: tensors whole, other items as they were saved
    (for an import, which saves them all in one ``dcp.save``)."""
    state: dict[str, object] = load_full(reader, found.tensors)
    if found.others:
        others: dict[str, object] = dict.fromkeys(found.others)
        with single_process(), reading_part():
            dcp.load(others, storage_reader=reader(), no_dist=True)
        state.update(others)
    return state
