"""A trainer's nested checkpoint dict as one DCP checkpoint, and back as it was.

Trainers such as Lightning hand over one nested dict: model and optimizer state next to
counters, loop progress, callback state and hyper-parameters. DCP's own flattening does
not give such a dict back unchanged: it turns every dict key into a string (an optimizer's
per-parameter state is keyed by ``int``), and a load needs a template of the same shape.
So the dict is split here instead:

* every plain strided tensor becomes its own DCP item, named by its path
  (``state_dict.layer.weight``): stored zero-copy and checksummed by the writer, listed by
  ``s3ckpt show``;
* what remains, the *skeleton*, with a meta-device tensor where each of those tensors was,
  is pickled once (``torch.save``) into one bytes item, :data:`SKELETON_KEY`. Anything
  the split does not handle (sparse or quantized tensors, tensors inside sets) stays in
  the skeleton whole, so nothing is lost.

Loading reads DCP's metadata for the stored tensors' shapes, loads every item into fresh
CPU tensors with ``dcp.load`` (no template needed from the caller), unpickles the skeleton
(with torch's weights-only unpickler unless the caller trusts the bucket) and puts each
tensor back at its placeholder. Saves and loads run on the calling process alone
(``no_dist``): trainers save from one rank and load on every rank.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from s3ckpt.dcp.compat import Metadata, StorageReader, StorageWriter, TensorStorageMetadata
from s3ckpt.errors import CheckpointError, ConfigError

SKELETON_KEY = "s3ckpt.nested.skeleton"
_FORMAT = 1
_EXTRACTED = (torch.Tensor, torch.nn.Parameter)


def split(tree: Any) -> tuple[dict[str, torch.Tensor], bytes]:
    """The tensors of ``tree`` by name, and the pickled skeleton that puts them back.

    ``tree`` itself is not modified: containers holding tensors are copied.
    """
    tensors: dict[str, torch.Tensor] = {}
    slots: dict[int, str] = {}  # position among the skeleton's meta tensors -> item name
    counter = [0]

    def visit(value: Any, path: tuple[str, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            if _extractable(value):
                name = _unique_name(".".join(path) or "tensor", tensors)
                tensors[name] = value.detach()
                slots[counter[0]] = name
                value = torch.empty(value.shape, dtype=value.dtype, device="meta")
            if value.device.type == "meta":
                counter[0] += 1
            return value
        return _rebuild(value, lambda key, item: visit(item, (*path, str(key))))

    skeleton = visit(tree, ())
    buffer = io.BytesIO()
    torch.save({"format": _FORMAT, "tree": skeleton, "slots": slots}, buffer)
    return tensors, buffer.getvalue()


def join(skeleton: bytes, tensors: dict[str, torch.Tensor], *, weights_only: bool | None) -> Any:
    """The tree :func:`split` took apart: the skeleton with each tensor back in place."""
    payload = torch.load(io.BytesIO(skeleton), weights_only=weights_only)
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise CheckpointError(f"unknown nested checkpoint format in {SKELETON_KEY}")
    slots: dict[int, str] = payload["slots"]
    counter = [0]

    def visit(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.device.type == "meta":
                position = counter[0]
                counter[0] += 1
                if position in slots:
                    return tensors[slots[position]]
            return value
        return _rebuild(value, lambda _key, item: visit(item))

    return visit(payload["tree"])


def nested_items(tree: Any, prefix: str = "") -> dict[str, Any]:
    """The DCP items that store ``tree``: its tensors and its skeleton, each name
    prefixed by ``prefix``, so several trees can share one checkpoint (one per file of
    a DeepSpeed checkpoint, :mod:`s3ckpt.integrations.deepspeed`)."""
    tensors, skeleton = split(tree)
    return {prefix + SKELETON_KEY: skeleton, **{prefix + k: v for k, v in tensors.items()}}


def save_nested(tree: dict[str, Any], writer: StorageWriter) -> None:
    """Save ``tree`` through ``writer`` (a DCP save on this process alone)."""
    dcp.save(nested_items(tree), storage_writer=writer, no_dist=True)


def load_nested(
    reader: StorageReader,
    *,
    weights_only: bool | None = None,
    map_location: str | torch.device | Callable[..., Any] | None = None,
    prefix: str = "",
    metadata: Metadata | None = None,
) -> Any:
    """Load a tree saved by :func:`save_nested` (or as :func:`nested_items` with
    ``prefix``); tensors on the CPU or ``map_location`` (a device, or a callable as
    ``torch.load`` takes one). ``metadata``: the reader's, if the caller read it already.

    ``weights_only`` is passed to ``torch.load`` for the skeleton: ``None`` is torch's
    default (weights-only), ``False`` trusts the bucket with arbitrary pickles.
    """
    placeable = map_location is None or isinstance(map_location, (str, torch.device))
    if not (placeable or callable(map_location)):
        raise ConfigError(
            f"map_location must be a device, a device name or a callable, got {map_location!r}"
        )
    metadata = metadata or reader.read_metadata()
    if prefix + SKELETON_KEY not in metadata.state_dict_metadata:
        raise CheckpointError(
            f"{getattr(reader, 'checkpoint_id', 'this checkpoint')} holds no "
            f"{prefix + SKELETON_KEY} item: it was not saved from a nested dict; load it "
            "with dcp.load and a state dict"
        )
    state: dict[str, Any] = {prefix + SKELETON_KEY: None}
    for name, item in metadata.state_dict_metadata.items():
        if name.startswith(prefix) and isinstance(item, TensorStorageMetadata):
            state[name] = torch.empty(item.size, dtype=item.properties.dtype)
    dcp.load(state, storage_reader=reader, no_dist=True)
    skeleton = state.pop(prefix + SKELETON_KEY)
    state = {name[len(prefix) :]: tensor for name, tensor in state.items()}
    if map_location is not None:
        state = {name: _placed(tensor, map_location) for name, tensor in state.items()}
    return join(skeleton, state, weights_only=weights_only)


def _placed(tensor: torch.Tensor, map_location: Any) -> torch.Tensor:
    """``tensor`` (loaded on the CPU) where ``map_location`` puts it. A callable is
    called as ``torch.load`` calls it, with the tensor's storage and its location,
    ``"cpu"`` (where s3ckpt loads every tensor); ``None`` or the same storage back
    keeps the tensor where it is."""
    if isinstance(map_location, (str, torch.device)):
        return tensor.to(map_location)
    storage = tensor.untyped_storage()
    moved = map_location(storage, "cpu")
    if moved is None or moved is storage:
        return tensor
    if isinstance(moved, torch.TypedStorage):
        moved = moved.untyped()
    placed = torch.empty(0, dtype=tensor.dtype, device=moved.device)
    return placed.set_(moved, tensor.storage_offset(), tensor.shape, tensor.stride())


def _extractable(tensor: torch.Tensor) -> bool:
    """Plain dense tensors with data: what a DCP item holds."""
    return (
        type(tensor) in _EXTRACTED
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and tensor.device.type != "meta"
    )


def _unique_name(name: str, taken: dict[str, torch.Tensor]) -> str:
    if name != SKELETON_KEY and name not in taken:
        return name
    suffix = 2
    while f"{name}#{suffix}" in taken:
        suffix += 1
    return f"{name}#{suffix}"


def _rebuild(value: Any, visit: Callable[[Any, Any], Any]) -> Any:
    """``value`` with ``visit(key, item)`` applied to each item of a dict, list or tuple.

    Dicts and lists are copied shallowly (keeping their type: ``OrderedDict``, a
    trainer's attribute dict), tuples and named tuples rebuilt when an item changed;
    anything else is a leaf.
    """
    if isinstance(value, dict):
        copied = copy.copy(value)
        for key, item in value.items():
            copied[key] = visit(key, item)
        return copied
    if isinstance(value, list):
        copied = copy.copy(value)
        for index, item in enumerate(value):
            copied[index] = visit(index, item)
        return copied
    if isinstance(value, tuple):
        items = [visit(index, item) for index, item in enumerate(value)]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value  # nothing inside changed (torch.Size, plain tuples of numbers)
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
