"""Copying a state dict into the :class:`~s3ckpt.background.arena.StagingArena`: the
part of a background save the training loop waits for.

Containers (dicts, lists, tuples) are walked; every tensor storage is copied once into an
arena region (tensors that share a storage, tied weights among them, share its copy and
keep their offsets and strides); a sharded tensor becomes a
:class:`~s3ckpt.background.shards.StagedShards` over its copied shards; any other value is
kept as it is and pickled with the save. Copies from an accelerator are queued without
waiting and the devices synchronized once at the end, so that with pinned segments the
loop waits for the copy engines, not for one copy after another.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from s3ckpt.background.arena import Region, Segment, StagingArena
from s3ckpt.background.rebuild import PLAIN_VALUES, ChildImports
from s3ckpt.background.shards import StagedShards
from s3ckpt.dcp.compat import has_lazy_bits, is_sharded_tensor, shard_write_items

_StorageKey = tuple[int, torch.device, int]  # data_ptr, device, nbytes


@dataclass
class ArenaCopy:
    """One save's copy: the state with arena tensors, the segments it added, and the
    regions its bytes lie in; ``placed``, the region of each arena tensor made for the
    state (by ``id``), so that pickling it need not look each one up again."""

    state_dict: dict[str, Any]
    new_segments: list[Segment]
    nbytes: int
    regions: list[Region] = field(default_factory=list)
    placed: dict[int, Region] = field(default_factory=dict)


@dataclass
class _Copies:
    """The storages a state holds, in the order they were met, and their copies."""

    storages: dict[_StorageKey, torch.UntypedStorage] = field(default_factory=dict)
    copies: dict[_StorageKey, tuple[torch.UntypedStorage, Region]] = field(default_factory=dict)
    placed: dict[int, Region] = field(default_factory=dict)  # each copy_of's, by id

    def note(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self.storages.setdefault(_key(storage), storage)

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` over the copy of its storage: same dtype, offset, shape, strides."""
        storage, region = self.copies[_key(tensor.untyped_storage())]
        staged = torch.empty(0, dtype=tensor.dtype).set_(
            storage, tensor.storage_offset(), tensor.size(), tensor.stride()
        )
        self.placed[id(staged)] = region
        return staged.requires_grad_() if tensor.requires_grad else staged


def copy_into_arena(
    arena: StagingArena, state_dict: dict[str, Any], imports: ChildImports | None = None
) -> ArenaCopy:
    """Copy ``state_dict`` (values already plain: no ``Stateful``) into ``arena``; returns
    once every byte has landed. The arena's previous copy is overwritten. With
    ``imports``, the values kept as they are (neither tensors nor plain numbers and
    strings) are first checked to be what that process can unpickle
    (:mod:`s3ckpt.background.rebuild`): one that is not raises before anything is copied."""
    copies = _Copies()
    sharded: dict[int, list[tuple[Any, torch.Tensor]]] = {}
    resolved: dict[int, torch.Tensor] = {}  # lazy conjugate/negative views, materialized
    kept: list[Any] = []  # values pickled with the save as they are

    def note(value: Any) -> Any:
        if _copyable(value):  # the common case first: a plain tensor is not sharded
            if has_lazy_bits(value):  # its bytes are not its values: copy the values
                resolved[id(value)] = value.resolve_conj().resolve_neg()
            copies.note(resolved.get(id(value), value))
        elif is_sharded_tensor(value):
            pieces = sharded[id(value)] = shard_write_items(value)
            for _, shard in pieces:
                copies.note(shard)
        elif type(value) not in PLAIN_VALUES:
            kept.append(value)
        return value

    _walk(state_dict, note)
    if imports is not None:
        imports.check(kept, state_dict)
    storages = list(copies.storages.items())
    regions, added = arena.allocate([storage.nbytes() for _, storage in storages])
    devices = _copy_all(arena, storages, regions, copies)
    for device in devices:
        torch.accelerator.synchronize(device)

    def replace(value: Any) -> Any:
        if id(value) in sharded:
            pieces = sharded[id(value)]
            return StagedShards.of([i for i, _ in pieces], [copies.copy_of(s) for _, s in pieces])
        if _copyable(value):
            return copies.copy_of(resolved.get(id(value), value))
        return value

    nbytes = sum(region.nbytes for region in regions)
    return ArenaCopy(_walk(state_dict, replace), added, nbytes, regions, copies.placed)


def _copy_all(
    arena: StagingArena,
    storages: list[tuple[_StorageKey, torch.UntypedStorage]],
    regions: list[Region],
    copies: _Copies,
) -> set[torch.device]:
    """Copy each storage into its region; the accelerators copied from (to synchronize).

    Both sides are viewed as the widest integers the length and the source's address
    allow, because torch copies uint8 slower than wider elements. The source is made a
    view of words directly and the region's tensor is the arena's, kept from the last
    save, to keep the Python per tensor small (docs/decisions/0007-staging-arena.md)."""
    devices: set[torch.device] = set()
    targets = arena.views(regions)
    for (key, storage), target, region in zip(storages, targets, regions, strict=True):
        copies.copies[key] = target.untyped_storage(), region
        nbytes = storage.nbytes()
        if nbytes == 0:
            continue
        words = _WORDS.get(_word_width(nbytes, storage.data_ptr()), torch.uint8)
        device = storage.device
        source = torch.empty(0, dtype=words, device=device).set_(storage)  # all its words
        on_device = device.type != "cpu"
        target.view(words).copy_(source, non_blocking=on_device)
        if on_device:
            devices.add(device)
    return devices


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _word_width(nbytes: int, address: int) -> int:
    """The widest of 8, 4, 2 bytes dividing both ``nbytes`` and ``address`` (1 if none);
    the arena's regions start on a page."""
    both = nbytes | address
    return both & -both if both & 7 else 8


def _copyable(value: Any) -> bool:
    """A tensor whose storage is copied as it is: plain, strided, with real memory."""
    return type(value) in _PLAIN and value.layout == torch.strided and not value.is_meta


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _walk(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with every leaf (what is not a dict, list or tuple) replaced by ``leaf``."""
    if isinstance(value, dict):
        kind = type(value) if type(value) in (dict, OrderedDict) else dict
        return kind((k, _walk(v, leaf)) for k, v in value.items())
    if isinstance(value, list):
        return [_walk(v, leaf) for v in value]
    if type(value) is tuple:
        return tuple(_walk(v, leaf) for v in value)
    return leaf(value)


def _key(storage: torch.UntypedStorage) -> _StorageKey:
    return storage.data_ptr(), storage.device, storage.nbytes()
