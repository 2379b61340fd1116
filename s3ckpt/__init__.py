"""s3ckpt: object-storage checkpoint engine for PyTorch Distributed Checkpoint.

Data flow of a save, module by module::

    dcp.save / dcp.async_save
      -> writer.S3StorageWriter        DCP adapter (lifecycle documented there)
         -> layout.plan_objects        which object and offset each item gets
         -> codec                      zero-copy tensor bytes, block CRC32Cs
         -> compression.encode_stream  optional zstd, byte-grouped, in worker threads
         -> upload.RankUploader        parts as tasks on the I/O loop (loop.io_loop)
            -> store.ObjectStore       typed S3 calls; errors mapped in error_mapping
         -> manifest.commit            DCP metadata, then the manifest: the commit

and of a load::

    dcp.load -> reader.S3StorageReader -> manifest + dcp_metadata (restricted unpickler)
             -> download.RangeReader   coalesced parallel ranged GETs into the tensors,
                                       each block's CRC32C checked as it streams in
             -> restore.decode         compressed items: zstd + byteplanes.merge_crc,
                                       each block checked as it is decoded
             -> restore.commit         verified items handed to the planner
"""

from typing import TYPE_CHECKING, Any

from s3ckpt._version import __version__
from s3ckpt.config import S3URI, S3Config
from s3ckpt.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitConflictError,
    ConfigError,
    CorruptCheckpointError,
    DeadlineExceededError,
    EndpointError,
    InvalidURIError,
    LocalServerError,
    ObjectNotFoundError,
    PreconditionFailedError,
    S3CkptError,
    StorageError,
    TransientStorageError,
)

if TYPE_CHECKING:
    from s3ckpt.compat import unwrap
    from s3ckpt.manager import CheckpointManager
    from s3ckpt.manager_policy import SaveMetrics
    from s3ckpt.reader import S3StorageReader
    from s3ckpt.writer import S3StorageWriter

# The DCP adapters import torch (seconds); the CLI and catalog do not need it.
_LAZY = {
    "CheckpointManager": "s3ckpt.manager",
    "S3StorageReader": "s3ckpt.reader",
    "S3StorageWriter": "s3ckpt.writer",
    "SaveMetrics": "s3ckpt.manager_policy",
    "unwrap": "s3ckpt.compat",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 's3ckpt' has no attribute {name!r}")


__all__ = [
    "S3URI",
    "AccessDeniedError",
    "BucketNotFoundError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CommitConflictError",
    "ConfigError",
    "CorruptCheckpointError",
    "DeadlineExceededError",
    "EndpointError",
    "InvalidURIError",
    "LocalServerError",
    "ObjectNotFoundError",
    "PreconditionFailedError",
    "S3CkptError",
    "S3Config",
    "S3StorageReader",
    "S3StorageWriter",
    "SaveMetrics",
    "StorageError",
    "TransientStorageError",
    "__version__",
    "unwrap",
]
