"""Optimizer state a fresh optimizer has no room for: read anyway, and handed to it.

DCP loads only what its target has room for. A ``torch.optim.Optimizer`` placed in the
state (``{"model": model, "optim": optimizer}``) gives ``optimizer.state_dict()`` as its
target, and a fresh optimizer's has no ``state`` entries: every saved moment would be
skipped, and the weights restored beside an optimizer that starts over. DCP asks for that
``state_dict()`` before a storage reader sees anything, so the readers
(:class:`~s3ckpt.dcp.reader.S3StorageReader`, :class:`~s3ckpt.dcp.state_reader.StateReader`)
complete the target here instead:

1. :func:`plan_fills`, in ``prepare_local_plan``: an optimizer state dict is a target whose
   ``<owner>.param_groups.*`` entries the rank reads. Every saved ``<owner>.state.<id>.<name>``
   entry of a parameter id the rank reads nothing of is added to the rank's plan, for the
   region the rank holds: the whole entry, or, when the entry has the global shape of tensors
   the rank reads as shards (FSDP2, DTensor), the same shard as theirs.
2. :class:`Fills`, in ``read_data``: those items land in tensors allocated here (as the
   ``DTensor`` of those shards' mesh and placements where they are ``DTensor`` s), and, once
   read, go into the optimizer state dict DCP hands to ``optimizer.load_state_dict``
   (keyed by the parameter id, as ``Optimizer.state_dict`` keys them): the optimizer gets
   every saved moment, cast to its parameters' dtype and device by torch as for any load.

The checkpoint's layout is ``optimizer.state_dict()``'s, unchanged: checkpoints saved either
way load either way. An optimizer saved before its first step has no ``state`` entries and
loads fresh. Entries whose place cannot be told (shards of two layouts of one shape) are
left out, and the load's report names them (:mod:`s3ckpt.dcp.load_report`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from s3ckpt.dcp.compat import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    Metadata,
    ReadItem,
    TensorStorageMetadata,
    as_dtensor,
    dtensor_spec_of,
    load_targets,
    local_chunk_of,
    narrow,
    read_items_for,
)

log = logging.getLogger(__name__)

_STATE_ENTRY = re.compile(r"^(?P<owner>.+)\.state\.(?P<pid>\d+)\.(?P<name>[^.]+)$")
_GROUPS = ".param_groups."


@dataclass
class Fill:
    """One saved optimizer state entry read into a tensor (or value) of its own."""

    fqn: str  # the saved entry: "<owner>.state.<id>.<name>"
    owner: str  # the optimizer state dict's flattened FQN
    pid: int
    name: str
    offsets: tuple[int, ...]  # the region this rank holds, in the saved tensor
    sizes: tuple[int, ...]
    shape: tuple[int, ...]  # the saved tensor's global shape (() for a value)
    twins: tuple[str, ...]  # targets of that shape read as the same region
    tensor: bool
    dtype: torch.dtype | None = None
    value: Any = field(default=None, repr=False)


def plan_fills(metadata: Metadata, plan: LoadPlan) -> tuple[LoadPlan, list[Fill]]:
    """``plan`` with the read items of every saved state entry of an optimizer target that
    has no room for it (see the module docstring), and what those items fill."""
    entries = metadata.state_dict_metadata
    reads = {item.dest_index.fqn for item in plan.items}
    owners = {fqn[: fqn.index(_GROUPS)] for fqn in reads if _GROUPS in fqn}
    if not owners:
        return plan, []
    taken = {(m["owner"], m["pid"]) for m in map(_STATE_ENTRY.match, reads) if m is not None}
    by_shape = _by_shape(_regions(plan), entries, owners)
    fills: list[Fill] = []
    items: list[ReadItem] = []
    for fqn, md in entries.items():
        match = _STATE_ENTRY.match(fqn)
        if match is None or match["owner"] not in owners:
            continue
        if (match["owner"], match["pid"]) in taken:
            continue
        fill = _fill_for(fqn, match, md, by_shape)
        if fill is None:
            log.debug("%s: no single region of its shape to load it as; left out", fqn)
            continue
        fills.append(fill)
        items += read_items_for(fqn, md, fill.offsets, fill.sizes)
    if not fills:
        return plan, []
    return dataclasses.replace(plan, items=list(plan.items) + items), fills


def _regions(plan: LoadPlan) -> dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Each tensor target the plan reads: the regions (offsets, sizes) this rank holds."""
    extents: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for item in plan.items:
        if item.type == LoadItemType.BYTE_IO:
            continue
        key = (item.dest_index.fqn, tuple(item.dest_index.offset or ()))
        ends = [o + n for o, n in zip(item.dest_offsets, item.lengths, strict=True)]
        known = extents.setdefault(key, ends)
        extents[key] = [max(a, b) for a, b in zip(known, ends, strict=True)]
    regions: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for (fqn, offsets), sizes in extents.items():
        regions.setdefault(fqn, set()).add((offsets, tuple(sizes)))
    return regions


_Region = tuple[tuple[int, ...], tuple[int, ...]]


_Twins = tuple[tuple[str, ...], frozenset[_Region]]


def _by_shape(
    regions: dict[str, set[_Region]], entries: dict[str, Any], owners: set[str]
) -> dict[tuple[int, ...], _Twins]:
    """The tensor targets outside the optimizers that the rank holds one region of, by
    their saved global shape, with the regions they hold (scalars left out: a step count
    is never a shard)."""
    prefixes = tuple(owner + "." for owner in owners)
    found: dict[tuple[int, ...], list[tuple[str, _Region]]] = {}
    for target, held in sorted(regions.items()):
        stored = entries.get(target)
        if target.startswith(prefixes) or not isinstance(stored, TensorStorageMetadata):
            continue
        if len(held) == 1 and len(stored.size) > 0:
            found.setdefault(tuple(stored.size), []).append((target, next(iter(held))))
    return {
        shape: (tuple(t for t, _ in twins), frozenset(r for _, r in twins))
        for shape, twins in found.items()
    }


def _fill_for(
    fqn: str, match: re.Match[str], md: Any, by_shape: dict[tuple[int, ...], _Twins]
) -> Fill | None:
    owner, pid, name = match["owner"], int(match["pid"]), match["name"]
    if not isinstance(md, TensorStorageMetadata):
        return Fill(fqn, owner, pid, name, (), (), (), (), tensor=False)
    shape = tuple(md.size)
    twins, found = by_shape.get(shape, ((), frozenset()))
    if len(found) > 1:
        return None
    offsets, sizes = next(iter(found)) if found else ((0,) * len(shape), shape)
    return Fill(fqn, owner, pid, name, offsets, sizes, shape, twins, True, md.properties.dtype)


class Fills:
    """The fills of one rank's load: the planner DCP gave ``read_data``, wrapped so that
    the fills' items land in tensors of their own; then :meth:`install`."""

    def __init__(self, fills: list[Fill]) -> None:
        self.fills = {fill.fqn: fill for fill in fills}
        self.left_out: list[str] = []

    def __bool__(self) -> bool:
        return bool(self.fills)

    def planner(self, planner: LoadPlanner, plan: LoadPlan) -> tuple[LoadPlanner, LoadPlan]:
        """The planner the reads go through, and ``plan`` less the fills that cannot be
        placed (a planner that does not keep its state dict; shards of other layouts)."""
        if not self.fills:
            return planner, plan
        targets = load_targets(planner)
        specs: dict[tuple[int, ...], set[Any]] = {}  # the twins' layouts, per shape
        for fill in list(self.fills.values()):
            if targets is not None and fill.shape not in specs:
                specs[fill.shape] = {_layout(targets[1].get(t)) for t in fill.twins}
            if targets is None or not _allocate(fill, specs[fill.shape]):
                self.left_out.append(self.fills.pop(fill.fqn).fqn)
        left_out = set(self.left_out)
        items = [item for item in plan.items if item.dest_index.fqn not in left_out]
        return _FillingPlanner(planner, self.fills), dataclasses.replace(plan, items=items)

    def install(self, planner: LoadPlanner) -> None:
        """Hand every fill to the optimizer state dict it belongs to (after the reads)."""
        targets = load_targets(planner)
        if targets is None or not self.fills:
            return
        original, _, mappings = targets
        states = _states_of(original, mappings, {fill.owner for fill in self.fills.values()})
        for fill in self.fills.values():
            state = states.get(fill.owner)
            if state is None:
                self.left_out.append(fill.fqn)
                continue
            state.setdefault(fill.pid, {})[fill.name] = fill.value
        log.debug("optimizer state read beyond the targets: %s", ", ".join(self.fills))


def _layout(target: Any) -> tuple[Any, torch.device | None]:
    """A target's ``DTensor`` layout (None for a plain tensor) and the device of its shard."""
    spec = dtensor_spec_of(target)
    return spec, _local(target).device if spec is not None else None


def _allocate(fill: Fill, layouts: set[tuple[Any, torch.device | None]]) -> bool:
    """Give a tensor fill its tensor: a ``DTensor`` of its twins' layout (``layouts``), its
    shard on their device, else a plain tensor in host memory (``load_state_dict`` moves it
    to its parameter's device). False if its twins disagree on what it is or where this
    rank's shard lies."""
    if not fill.tensor:
        return True
    assert fill.dtype is not None
    if len(layouts) > 1:
        return False
    spec, device = next(iter(layouts)) if layouts else (None, None)
    local = torch.empty(fill.sizes, dtype=fill.dtype, device=device)
    if spec is None:
        if fill.sizes != fill.shape:  # a shard of a plain tensor: no layout to give it
            return False
        fill.value = local
        return True
    if local_chunk_of(fill.shape, spec) != (fill.offsets, fill.sizes):
        return False
    fill.value = as_dtensor(local, spec, fill.shape)
    return True


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def _states_of(
    original: dict[str, Any], mappings: dict[str, Any], owners: set[str]
) -> dict[str, dict[Any, Any]]:
    """The ``state`` dict of each optimizer state dict flattened as one of ``owners``,
    found through the path of one of its ``param_groups`` entries."""
    states: dict[str, dict[Any, Any]] = {}
    for fqn, path in mappings.items():
        if _GROUPS not in fqn:
            continue
        owner = fqn[: fqn.index(_GROUPS)]
        if owner in states or owner not in owners:
            continue
        for end in range(1, len(path)):
            if ".".join(map(str, path[:end])) != owner:
                continue
            node: Any = original
            for key in path[:end]:
                node = node[key]
            if isinstance(node, dict):
                state = node.setdefault("state", {})
                if isinstance(state, dict):
                    states[owner] = state
            break
    return states


class _FillingPlanner:
    """DCP's planner, except for the fills' items: those resolve to the fills' own tensors."""

    def __init__(self, planner: LoadPlanner, fills: dict[str, Fill]) -> None:
        self._planner = planner
        self._fills = fills

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def _fill(self, item: ReadItem) -> Fill | None:
        return self._fills.get(item.dest_index.fqn)

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        fill = self._fill(item)
        if fill is None:
            return self._planner.resolve_tensor(item)
        return narrow(_local(fill.value), item.dest_offsets, item.lengths)

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        if self._fill(item) is None:
            self._planner.commit_tensor(item, tensor)

    def load_bytes(self, item: ReadItem, value: Any) -> None:
        fill = self._fill(item)
        if fill is None:
            self._planner.load_bytes(item, value)
            return
        fill.value = torch.load(value, weights_only=False)
