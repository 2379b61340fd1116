"""Everything s3ckpt needs from torch beyond DCP's public storage API, in one package.

Only public names are imported here; each module takes apart one difference between
what DCP offers publicly and what s3ckpt needs, and its docstring names the private
details it relies on:

* :mod:`~s3ckpt.dcp.compat.metadata_globals`: how DCP's ``Metadata`` pickles (the globals
  its pickle refers to, :func:`metadata_global`, and how ``TensorProperties`` grew
  between releases);
* :mod:`~s3ckpt.dcp.compat.dcp_calls`: a save without what ``dcp.save`` adds around its
  plan (:func:`save_plain`), a single-process call (:func:`single_process`), and how to
  stop DCP's process-mode ``async_save`` background process
  (:func:`stop_async_save_process`);
* :mod:`~s3ckpt.dcp.compat.failures`: the error a rank raised inside DCP's
  ``CheckpointException`` (:func:`unwrap`), how a rank's failure travels among gathered
  results (:func:`wrap_exception`, for the Megatron integration), and which frame of
  ``dcp.load`` asks a reader for the metadata (:func:`read_by_dcp_load`, so that a failed
  read is reported once, as itself);
* :mod:`~s3ckpt.dcp.compat.storage_copier`: DCP's storage copier that keeps staging
  buffers (:func:`storage_copier`, for :mod:`s3ckpt.dcp.staging`);
* :mod:`~s3ckpt.dcp.compat.tensors`: tensor subclasses, lazy bits, pinned host memory,
  the bytes and views of items and chunks;
* :mod:`~s3ckpt.dcp.compat.sharded`: the write items and layout of sharded tensors;
* :mod:`~s3ckpt.dcp.compat.planner`: what DCP's default planners keep and make;
* :mod:`~s3ckpt.dcp.compat.process_group`: how long a process group's collectives wait
  (:func:`group_timeout`, its backend's options) and where its ranks met;
* :mod:`~s3ckpt.dcp.compat.torch_save`: how to lay out a ``torch.save`` file without its
  tensors' bytes (:func:`save_skeleton`, for export).

``tests/unit/dcp/test_compat.py`` and ``tests/unit/interop/test_formats.py`` fail loudly when a
torch release changes any of them.
"""

from __future__ import annotations

import torch
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

from s3ckpt.dcp.compat.dcp_calls import save_plain, single_process, stop_async_save_process
from s3ckpt.dcp.compat.failures import (
    read_by_dcp_load,
    remember_metadata_failure,
    stand_in_metadata,
    unwrap,
    wrap_exception,
)
from s3ckpt.dcp.compat.metadata_globals import metadata_global
from s3ckpt.dcp.compat.planner import (
    chunk_shapes,
    load_targets,
    plans_cached_by_dcp,
    read_items_for,
)
from s3ckpt.dcp.compat.process_group import default_store_host, group_timeout
from s3ckpt.dcp.compat.sharded import (
    as_dtensor,
    dtensor_spec_of,
    is_sharded_tensor,
    local_chunk_of,
    shard_write_items,
)
from s3ckpt.dcp.compat.storage_copier import StorageCopier, storage_copier
from s3ckpt.dcp.compat.tensors import (
    disabled_torch_function,
    has_lazy_bits,
    item_nbytes,
    narrow,
    pin_host_memory,
    tensor_subclass_of,
    unpin_host_memory,
)
from s3ckpt.dcp.compat.torch_save import save_skeleton

TORCH_VERSION = torch.__version__

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
    "StorageCopier",
    "StorageMeta",
    "StorageReader",
    "StorageWriter",
    "TensorProperties",
    "TensorStorageMetadata",
    "WriteItem",
    "WriteItemType",
    "WriteResult",
    "as_dtensor",
    "chunk_shapes",
    "default_store_host",
    "disabled_torch_function",
    "dtensor_spec_of",
    "group_timeout",
    "has_lazy_bits",
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
    "save_plain",
    "save_skeleton",
    "shard_write_items",
    "single_process",
    "stand_in_metadata",
    "stop_async_save_process",
    "storage_copier",
    "tensor_subclass_of",
    "unpin_host_memory",
    "unwrap",
    "wrap_exception",
]
