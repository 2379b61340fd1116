"""s3ckpt: object-storage checkpoint engine for PyTorch Distributed Checkpoint.

One subpackage per part of the architecture (``docs/architecture.md``)::

    dcp/       the DCP adapters: S3StorageWriter, S3StorageReader (only part knowing DCP)
    format/    the on-store format: keys, StoredItem, manifest schema, checksums, compression
    transfer/  bytes to objects and back: parts, upload, download, the commit
    s3/        the S3 transport on one asyncio loop: store, client, retries, HTTP pieces
    catalog/   list, show, verify, prune, gc, rm (no torch)
    cli/       the s3ckpt command over the catalog (no torch)
    manager/   CheckpointManager for training loops
    background/  the background saver: the checkpoint process (shared staging memory,
               one persistent process per rank) and thread mode, for the manager and
               the integrations; CheckpointProcess for dcp.async_save users
    tier/      the memory tier: recent checkpoints held in shared memory per node, the
               restore that agrees across ranks on a step every rank holds intact;
               TieredCheckpointProcess for dcp.async_save users
    interop/   export to safetensors/torch files, import, copy between stores
    testing/   the embedded S3 server (the engine never imports it)

Data flow of a save, module by module::

    dcp.save / dcp.async_save
      -> dcp.writer.S3StorageWriter          lifecycle documented there
         -> dcp.tensor_bytes                 zero-copy tensor bytes
         -> format.checksums.block_crcs,     block CRC32Cs, or optional zstd (byte-grouped)
            or format.compression.Compressor      in worker threads
         -> transfer.upload.RankUploader     packs items into objects (format.layout keys);
                                             parts (transfer.parts) as tasks on s3.loop
            -> s3.store.ObjectStore          typed S3 calls; errors mapped in s3.error_mapping
         -> transfer.commit.commit_manifest  DCP metadata, then the manifest: the commit

and of a load::

    dcp.load -> dcp.reader.S3StorageReader   manifest (transfer.commit.read_manifest) and
                                             DCP metadata (dcp.metadata_pickle, restricted)
             -> transfer.download.Downloader coalesced parallel ranged GETs into the
                                             tensors, each block's CRC32C checked in flight
             -> dcp.restore.decode           compressed items: zstd + byteplanes.merge_crc,
                                             each block checked as it is decoded
             -> dcp.restore.hand_to_planner  verified items handed to DCP's planner
"""

from typing import TYPE_CHECKING

from s3ckpt._lazy import lazy_attributes
from s3ckpt._version import __version__
from s3ckpt.config import S3URI, S3Config
from s3ckpt.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointProcessError,
    CheckpointReplacedError,
    CommitConflictError,
    ConfigError,
    CorruptCheckpointError,
    DeadlineExceededError,
    EndpointError,
    ForeignObjectError,
    IncompleteSaveError,
    InvalidURIError,
    LocalServerError,
    MemoryTierError,
    NotACheckpointError,
    NotS3EndpointError,
    ObjectNotFoundError,
    OutputExistsError,
    PreconditionFailedError,
    S3CkptError,
    StateMismatchError,
    StorageError,
    StoreFullError,
    StoreStalledError,
    TransientStorageError,
    UnpicklableStateError,
    UntrustedPickleError,
)

if TYPE_CHECKING:
    from s3ckpt.background.process import CheckpointProcess
    from s3ckpt.catalog.steps import step_name, step_of
    from s3ckpt.dcp.compat import unwrap
    from s3ckpt.dcp.local_plan import ReusingSavePlanner
    from s3ckpt.dcp.reader import S3StorageReader
    from s3ckpt.dcp.staging import HostStager
    from s3ckpt.dcp.writer import S3StorageWriter
    from s3ckpt.interop.copy import copy_checkpoint
    from s3ckpt.interop.export import export_checkpoint
    from s3ckpt.interop.imports import import_checkpoint
    from s3ckpt.manager import CheckpointManager, SaveMetrics
    from s3ckpt.tier.options import MemoryTier
    from s3ckpt.tier.process import TieredCheckpointProcess, TierSave

# The DCP adapters import torch (seconds); the CLI and catalog do not need it.
_LAZY = {
    "CheckpointManager": "s3ckpt.manager",
    "CheckpointProcess": "s3ckpt.background.process",
    "HostStager": "s3ckpt.dcp.staging",
    "MemoryTier": "s3ckpt.tier.options",
    "ReusingSavePlanner": "s3ckpt.dcp.local_plan",
    "S3StorageReader": "s3ckpt.dcp.reader",
    "S3StorageWriter": "s3ckpt.dcp.writer",
    "SaveMetrics": "s3ckpt.manager",
    "TierSave": "s3ckpt.tier.process",
    "TieredCheckpointProcess": "s3ckpt.tier.process",
    "copy_checkpoint": "s3ckpt.interop.copy",
    "export_checkpoint": "s3ckpt.interop.export",
    "import_checkpoint": "s3ckpt.interop.imports",
    "step_name": "s3ckpt.catalog.steps",
    "step_of": "s3ckpt.catalog.steps",
    "unwrap": "s3ckpt.dcp.compat",
}


__getattr__ = lazy_attributes(__name__, _LAZY, globals())


__all__ = [
    "S3URI",
    "AccessDeniedError",
    "BucketNotFoundError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointProcess",
    "CheckpointProcessError",
    "CheckpointReplacedError",
    "CommitConflictError",
    "ConfigError",
    "CorruptCheckpointError",
    "DeadlineExceededError",
    "EndpointError",
    "ForeignObjectError",
    "HostStager",
    "IncompleteSaveError",
    "InvalidURIError",
    "LocalServerError",
    "MemoryTier",
    "MemoryTierError",
    "NotACheckpointError",
    "NotS3EndpointError",
    "ObjectNotFoundError",
    "OutputExistsError",
    "PreconditionFailedError",
    "ReusingSavePlanner",
    "S3CkptError",
    "S3Config",
    "S3StorageReader",
    "S3StorageWriter",
    "SaveMetrics",
    "StateMismatchError",
    "StorageError",
    "StoreFullError",
    "StoreStalledError",
    "TierSave",
    "TieredCheckpointProcess",
    "TransientStorageError",
    "UnpicklableStateError",
    "UntrustedPickleError",
    "__version__",
    "copy_checkpoint",
    "export_checkpoint",
    "import_checkpoint",
    "step_name",
    "step_of",
    "unwrap",
]
