"""Everything s3ckpt needs from torch beyond DCP's public storage API, in one place.

Only public names are imported at module level. The private details s3ckpt relies on:
how DCP's ``Metadata`` pickles (the globals its pickle refers to,
:func:`metadata_global`, and how ``TensorProperties`` grew between releases), how to stop DCP's process-mode ``async_save``
background process (:func:`stop_async_save_process`), how to lay out a ``torch.save``
file without its tensors' bytes (:func:`save_skeleton`, for export), and DCP's storage
copier that keeps staging buffers (:func:`storage_copier`, for :mod:`s3ckpt.dcp.staging`),
how a rank's failure travels among gathered results (:func:`wrap_exception`, for the
Megatron integration), and which frame of ``dcp.load`` asks a reader for the metadata
(:func:`read_by_dcp_load`, so that a failed read is reported once, as itself), and how
long a process group's collectives wait (:func:`group_timeout`, its backend's options).
``tests/unit/test_compat.py`` and ``tests/unit/test_export_formats.py`` fail loudly when a
torch release changes any of them.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Iterator, Sequence
from types import CodeType, FrameType
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint.metadata as _metadata_module
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

TORCH_VERSION = torch.__version__

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


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """A ``dcp.load``/``dcp.save`` asked to run on this process alone (``no_dist``), without
    the warning DCP gives every such call: here it is the intent, not a guess."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_plain(
    state_dict: dict[str, Any],
    storage_writer: StorageWriter,
    *,
    planner: Any = None,
    process_group: Any = None,
    no_dist: bool = False,
) -> Metadata:
    """``dcp.save`` of a state dict that holds no ``Stateful`` (a staged copy), through
    DCP's private ``_save_state_dict``: the same plan, collectives and storage lifecycle,
    without what ``dcp.save`` adds before it. ``dcp.save`` wraps each top-level value's
    ``state_dict()`` call in its method logger, which builds a ``uuid4`` (a ``getrandom``
    system call, so a release and retake of the GIL) and two log records per key: one
    retake per top-level key, from a thread beside the training loop in thread mode
    (docs/decisions/0008-thread-mode-gil.md). Where the private function is gone,
    ``dcp.save`` itself."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict_saver

    save = getattr(state_dict_saver, "_save_state_dict", None)
    if save is None:
        with single_process() if no_dist else contextlib.nullcontext():
            return dcp.save(
                state_dict, storage_writer=storage_writer, planner=planner,
                process_group=process_group, no_dist=no_dist,
            )  # fmt: skip
    no_dist = no_dist or not dist.is_available() or not dist.is_initialized()
    return save(
        state_dict=state_dict, storage_writer=storage_writer, planner=planner,
        process_group=process_group, no_dist=no_dist,
    )  # fmt: skip


def unwrap(exc: BaseException) -> BaseException:
    """The error a rank raised inside DCP's ``CheckpointException``, else ``exc`` itself.

    ``dcp.save``/``dcp.load`` collect each rank's exception into a ``CheckpointException``
    (a ``BaseException``); this returns the first failing rank's original s3ckpt error so
    callers can match on the documented hierarchy. ``dcp.load`` replaces a failure to read
    the metadata (no checkpoint, no access...) with its own ``AssertionError("metadata is
    None; ...")``, which quotes the message only; the reader records the original on its
    thread (:func:`remember_metadata_failure`), and it is returned here.
    """
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and failures:
        first = failures[min(failures)]
        exc = first[0] if isinstance(first, tuple) else first
    recorded = _metadata_failures.get(threading.get_ident())
    if isinstance(exc, AssertionError) and recorded is not None and str(recorded) in str(exc):
        return recorded
    return exc


_metadata_failures: dict[int, BaseException] = {}


def read_by_dcp_load(caller: FrameType | None) -> bool:
    """Whether ``caller``, the frame that called a reader's ``read_metadata``, is the
    planning step of ``dcp.load`` (``local_step`` in DCP's private ``_load_state_dict``).

    DCP catches a failure raised there, logs it on the root logger as a warning with its
    whole traceback ("Global metadata is not found. Falling back to rank local
    metadata."), then raises ``AssertionError("metadata is None; ...")`` in its place.
    A reader called from there returns :func:`stand_in_metadata` instead and raises its
    error from ``set_up_storage_reader``, DCP's next call, outside that ``try``: DCP then
    hands the error itself to every rank, and logs nothing. False on a torch whose
    ``_load_state_dict`` has no such step (the reader raises then, as anywhere else).
    """
    return caller is not None and caller.f_code is _dcp_load_step()


@functools.cache
def _dcp_load_step() -> CodeType | None:
    import inspect

    from torch.distributed.checkpoint import state_dict_loader

    load = getattr(state_dict_loader, "_load_state_dict", None)
    code = getattr(inspect.unwrap(load), "__code__", None) if load is not None else None
    for const in code.co_consts if code is not None else ():
        if isinstance(const, CodeType) and const.co_name == "local_step":
            return const
    return None


def stand_in_metadata() -> Metadata:
    """An empty ``Metadata``: what a reader whose metadata read failed gives ``dcp.load``'s
    planning step (:func:`read_by_dcp_load`); the planner only keeps it, and the reader
    raises its error at DCP's next call."""
    return Metadata(state_dict_metadata={})


def wrap_exception(exc: BaseException) -> Any:
    """``exc`` as DCP carries a rank's failure among gathered results (its private
    ``_wrap_exception``): what Megatron's async save finalization looks for in the write
    results of each rank (``_get_failure_dict``)."""
    from torch.distributed.checkpoint.api import _wrap_exception

    return _wrap_exception(exc)


def remember_metadata_failure(error: BaseException | None) -> None:
    """Record (or, with ``None``, clear) this thread's last metadata-read failure."""
    if error is None:
        _metadata_failures.pop(threading.get_ident(), None)
    else:
        _metadata_failures[threading.get_ident()] = error


def stop_async_save_process(timeout: float = 30.0) -> bool:
    """Stop DCP's process-mode ``async_save`` background process, if one is running.

    DCP starts that process on the first process-mode save and offers no public way to
    stop it; it would otherwise live until the interpreter exits. Uses DCP's private
    module; returns whether a process was stopped. ``tests/unit/test_compat.py`` pins the
    names used.
    """
    from torch.distributed.checkpoint import _async_process_executor as executor

    process = executor._CHECKPOINT_PROCESS
    if process is None:
        return False
    try:
        process._send(executor._CheckpointSaveProcessControlOpts.TERMINATE)
        process._save_process.join(timeout=timeout)
    finally:
        if process._save_process.is_alive():
            process._save_process.terminate()
        executor._CHECKPOINT_PROCESS = None
    return True


class StorageCopier(Protocol):
    """DCP's ``StateDictStager``: deep-copies a state dict to host memory, each tensor
    storage into a host buffer cached (weakly, by source storage) for the next copy.
    ``devices``: the device of every storage the last :meth:`stage` copied."""

    devices: set[torch.device]

    def stage(self, state_dict: Any, non_blocking: bool = False) -> Any: ...

    def close(self) -> None: ...


def storage_copier(*, pin_memory: bool, share_memory: bool) -> StorageCopier:
    """DCP's private ``StateDictStager``, which its ``DefaultStager`` wraps.

    Used directly because some torch releases (2.11 among them) make ``DefaultStager``
    close this copier after every stage: that frees the cached buffers, so nothing is
    reused, and breaks the next stage of any dict (``KeyError: <class 'type'>``).

    It also records the device of each storage it copies, through the one method every
    copy goes through (``_stage_untyped_storage``): non-blocking copies are complete only
    once each of those devices is synchronized, and tensors sit where no walk of dicts
    and attributes finds them (a ``ShardedTensor`` reports the CPU, its shards hold the
    data in slots). ``tests/unit/test_compat.py`` pins the names used.

    A ``DTensor`` is copied as its local tensor and made again around the copy: DCP's own
    walk asks a tensor subclass for its storage when its ``data_ptr()`` is not 0, and a
    ``DTensor`` over a view that starts inside its storage (a shard cut from a larger
    tensor or buffer) reports its offset there, while the wrapper has no storage to give:
    the copy fails with "invalid python storage" (torch 2.13 and 2.15).
    """
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager
    from torch.distributed.tensor import DTensor

    class RecordingCopier(StateDictStager):
        def __init__(self) -> None:
            super().__init__(pin_memory=pin_memory, share_memory=share_memory)
            self.devices: set[torch.device] = set()

        def stage(self, state_dict: Any, non_blocking: bool = False) -> Any:
            self.devices = set()
            return super().stage(state_dict, non_blocking=non_blocking)

        def _stage_untyped_storage(self, storage: Any, non_blocking: bool = False) -> Any:
            self.devices.add(storage.device)
            return super()._stage_untyped_storage(storage, non_blocking=non_blocking)

        def _offload_tensor(self, x: Any, memo: Any, non_blocking: bool = False) -> Any:
            if not isinstance(x, DTensor):
                return super()._offload_tensor(x, memo, non_blocking=non_blocking)
            local = self.deepcopy_with_tensor_offload(x.to_local(), memo, [], non_blocking)
            # its own spec: ``from_local`` would move the host copy back to the mesh's device
            copied = DTensor(local, x._spec, requires_grad=False)
            memo[id(x)] = copied
            return copied

    return RecordingCopier()


def shard_write_items(obj: Any) -> list[tuple[WriteItem, torch.Tensor]]:
    """The write items DCP's default planner makes for a sharded tensor (a ``DTensor``, a
    ``ShardedTensor``, any object with DCP's ``__create_write_items__``), each with the
    local tensor that holds its bytes; the items' FQN is left empty, for the planner to
    fill in. A ``DTensor`` whose mesh leaves this rank out has none, as in DCP's
    ``create_default_local_save_plan``. Uses DCP's private ``_create_write_items``.
    """
    from torch.distributed.checkpoint.planner_helpers import _create_write_items
    from torch.distributed.checkpoint.utils import find_tensor_shard
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
        return []
    return [(item, find_tensor_shard(obj, item.index)) for item in _create_write_items("", obj)]


def is_sharded_tensor(obj: Any) -> bool:
    """Whether DCP saves ``obj`` as shards with their own offsets (``DTensor``,
    ``ShardedTensor``, or an object of DCP's ``_Checkpointable`` protocol)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(obj, ShardedTensor) or hasattr(obj, "__create_write_items__")


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


def plans_cached_by_dcp(planner: Any) -> bool:
    """Whether ``planner`` was made with DCP's own ``enable_plan_caching`` (its private
    ``_enable_plan_caching``; False on releases without it)."""
    return bool(getattr(planner, "_enable_plan_caching", False))


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


def default_store_host() -> str | None:
    """The host the default process group met at, when it met through a ``TCPStore``
    (DCP's private ``_get_default_store``): where ranks on other nodes reach rank 0."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    while not isinstance(store, dist.TCPStore) and hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store.host if isinstance(store, dist.TCPStore) else None


def group_timeout(group: Any = None) -> float | None:
    """Seconds a collective of ``group`` (default: the default group) waits for its peers,
    as the job set it at ``init_process_group`` (its CPU backend's options); None where
    torch does not say."""
    import torch.distributed as dist

    try:
        backend = (group or dist.group.WORLD)._get_backend(torch.device("cpu"))
        return float(backend.options._timeout.total_seconds())
    except Exception:
        return None


def save_skeleton(tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], path: str) -> None:
    """A ``torch.save`` file of ``{name: tensor}`` with every tensor's bytes left out.

    The file has the final layout (pickle, one ``data/<n>`` zip record per tensor, in dict
    order, sized for its bytes) but no tensor is ever allocated: fake tensors stand in, and
    ``torch.serialization.skip_data`` leaves their records empty, for the export to fill
    in as the real tensors arrive. Relies on torch's private ``FakeTensorMode``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = {name: torch.empty(shape, dtype=dtype) for name, dtype, shape in tensors}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(fake, path)


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


def chunk_shapes(metadata: Metadata) -> dict[MetadataIndex, tuple[torch.dtype, torch.Size]]:
    """dtype and stored shape of every tensor chunk, keyed like ``storage_data``."""
    shapes: dict[MetadataIndex, tuple[torch.dtype, torch.Size]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for index, chunk in enumerate(md.chunks):
                key = MetadataIndex(fqn, chunk.offsets, index)
                shapes[key] = (md.properties.dtype, chunk.sizes)
    return shapes


def load_targets(planner: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]] | None:
    """What a load planner loads into: the state dict handed to ``dcp.load`` (after
    ``Stateful`` objects gave their ``state_dict()``), its flattened view (FQN -> target)
    and the path of every flattened FQN in the former; None for a planner that does not
    keep them. DCP's ``DefaultLoadPlanner`` keeps them as ``original_state_dict``,
    ``state_dict`` and ``mappings`` (attributes of the class, not of the planner API)."""
    original = getattr(planner, "original_state_dict", None)
    flat = getattr(planner, "state_dict", None)
    mappings = getattr(planner, "mappings", None)
    if not getattr(planner, "flatten_state_dict", False):
        return None
    if not isinstance(original, dict) or not isinstance(flat, dict):
        return None
    if not isinstance(mappings, dict):
        return None
    return original, flat, mappings


def read_items_for(
    fqn: str, md: Any, offsets: Sequence[int], sizes: Sequence[int]
) -> list[ReadItem]:
    """DCP's read items that fill a local chunk (``offsets``/``sizes`` in the stored
    tensor ``fqn``) from the chunks stored, or read a non-tensor entry whole (DCP's
    ``create_read_items_for_chunk_list``, and its private ``_create_read_items`` for
    bytes)."""
    from torch.distributed.checkpoint.planner_helpers import (
        _create_read_items,
        create_read_items_for_chunk_list,
    )

    if isinstance(md, BytesStorageMetadata):
        return _create_read_items(fqn, md, None)
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    return create_read_items_for_chunk_list(fqn, md, [chunk])


def dtensor_spec_of(tensor: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """A ``DTensor``'s mesh and placements; None for anything else."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return None
    return tensor.device_mesh, tuple(tensor.placements)


def as_dtensor(local: torch.Tensor, spec: tuple[Any, tuple[Any, ...]], shape: Sequence[int]) -> Any:
    """``local`` (this rank's shard of a tensor of global ``shape``) as a ``DTensor`` with
    the mesh and placements of ``spec``, no collective."""
    from torch.distributed.tensor import DTensor

    mesh, placements = spec
    stride = torch.empty(tuple(shape), device="meta").stride()
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def local_chunk_of(
    shape: Sequence[int], spec: tuple[Any, tuple[Any, ...]]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Offsets and sizes of this rank's shard of a ``DTensor`` of global ``shape`` laid out
    as ``spec`` (DTensor's private ``compute_local_shape_and_global_offset``); None when
    this rank is outside the mesh."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = spec
    if mesh.get_coordinate() is None:
        return None
    sizes, offsets = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    return tuple(offsets), tuple(sizes)


__all__ = [
    "TORCH_VERSION",
    "BytesStorageMetadata",
    "CheckpointException",
    "ChunkStorageMetadata",
    "LoadItemType",
    "LoadPlan",
    "LoadPlanner",
    "Metadata",
    "MetadataIndex",
    "ReadItem",
    "SavePlan",
    "SavePlanner",
    "StorageMeta",
    "StorageReader",
    "StorageWriter",
    "TensorStorageMetadata",
    "WriteItem",
    "WriteItemType",
    "WriteResult",
    "as_dtensor",
    "chunk_shapes",
    "default_store_host",
    "disabled_torch_function",
    "dtensor_spec_of",
    "is_sharded_tensor",
    "item_nbytes",
    "load_targets",
    "local_chunk_of",
    "metadata_global",
    "narrow",
    "pin_host_memory",
    "plans_cached_by_dcp",
    "read_by_dcp_load",
    "read_items_for",
    "remember_metadata_failure",
    "save_skeleton",
    "shard_write_items",
    "stand_in_metadata",
    "stop_async_save_process",
    "tensor_subclass_of",
    "unpin_host_memory",
    "unwrap",
    "wrap_exception",
]
