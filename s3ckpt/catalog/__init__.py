"""The catalog: list, show, verify, prune, garbage-collect and remove checkpoints. No torch.

Everything here works from manifests and listings alone, so the ``s3ckpt`` command and
scripts manage checkpoints without importing torch. One module per operation:

* :mod:`~s3ckpt.catalog.api`: the functions scripts and the CLI call (sync and ``a``-async);
* :mod:`~s3ckpt.catalog.scan`: one listing of a prefix, grouped by checkpoint;
* :mod:`~s3ckpt.catalog.retention`: which checkpoints a retention policy deletes (pure);
* :mod:`~s3ckpt.catalog.verify`: re-read a checkpoint and check every size and CRC32C;
* :mod:`~s3ckpt.catalog.gc`: leftovers of failed saves, after a grace period;
* :mod:`~s3ckpt.catalog.reporting`: the progress protocol long operations report to.
"""

from s3ckpt.catalog.api import (
    CheckpointInfo,
    PruneReport,
    Removed,
    alist_checkpoints,
    aprune,
    aremove_checkpoint,
    list_checkpoints,
    prune,
    remove_checkpoint,
    show_checkpoint,
)
from s3ckpt.catalog.gc import AbortedUpload, Garbage, GcReport, collect_garbage
from s3ckpt.catalog.retention import Decision
from s3ckpt.catalog.verify import Problem, VerifyReport, verify_checkpoint

__all__ = [
    "AbortedUpload",
    "CheckpointInfo",
    "Decision",
    "Garbage",
    "GcReport",
    "Problem",
    "PruneReport",
    "Removed",
    "VerifyReport",
    "alist_checkpoints",
    "aprune",
    "aremove_checkpoint",
    "collect_garbage",
    "list_checkpoints",
    "prune",
    "remove_checkpoint",
    "show_checkpoint",
    "verify_checkpoint",
]
