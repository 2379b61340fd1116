"""torch-checkpointing on S3: its ``Storage`` over s3ckpt's engine, committed the s3ckpt way.

torch-checkpointing (meta-pytorch) writes each checkpoint's files through a ``Storage``
and, by default, commits by renaming a ``tmp_`` directory; on S3 a rename is a copy and a
delete per object, neither atomic nor cheap. Here the files are written in place as the
data objects of an s3ckpt save and the commit is a manifest written last::

    from torch_checkpointing import CheckpointManager
    from s3ckpt.integrations.torch_checkpointing import manager_config

    manager = CheckpointManager(manager_config("s3://ckpt/run1", endpoint_url=...))
    manager.save("s3://ckpt/run1/step-100", {"model": model.state_dict(), "step": 100})
    ...
    manager.load("s3://ckpt/run1/step-100", into={"model": model.state_dict(), "step": 0})

:func:`manager_config` sets what this needs: :class:`S3StorageConfig`, writing in place
(``write_to_temp_dir=False``), and two callbacks around torch-checkpointing's barrier:

1. before it (``pre_finalize_callback``), every rank writes its index object: each file
   it wrote, with its data object and block CRC32Cs;
2. after it (``finalize_callback``), rank 0 reads every rank's index, checks that every
   object is there with its size, writes the metadata object and the manifest (a
   conditional create, as every s3ckpt commit). Until then nothing is visible: a save
   that dies leaves objects ``s3ckpt gc`` removes, and an earlier checkpoint untouched.

The checkpoints are s3ckpt's like any other: ``s3ckpt ls``, ``verify``, ``prune``, ``rm``
and ``gc`` see them, and ``dcp.load`` with an ``S3StorageReader`` reads each file as a
bytes item named by its file name. A checkpoint name is the first path part under the run
(``s3://ckpt/run1/<name>/...``); saving onto a committed one is refused (torch-
checkpointing's own rule for an occupied destination).
"""

from __future__ import annotations

from s3ckpt.integrations.torch_checkpointing.storage import (
    S3Storage,
    S3StorageConfig,
    Then,
    commit_checkpoint,
    manager_config,
    write_rank_index,
)

__all__ = [
    "S3Storage",
    "S3StorageConfig",
    "Then",
    "commit_checkpoint",
    "manager_config",
    "write_rank_index",
]
