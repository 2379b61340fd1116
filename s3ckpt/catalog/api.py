"""Managing the checkpoints under a prefix: list, show, remove, prune.

The CLI is a thin layer over these functions, which scripts can call directly. Each has
an ``async`` form taking an :class:`ObjectStore` (run it on :func:`s3ckpt.s3.loop.io_loop`)
and a synchronous wrapper taking an ``s3://`` URI plus the usual connection options.
:mod:`s3ckpt.catalog` re-exports them with garbage collection and verification.

One module per command family, re-exported here:

* :mod:`~s3ckpt.catalog.listing`: ``ls``, a :class:`CheckpointInfo` row per checkpoint;
* :mod:`~s3ckpt.catalog.committed`: the committed names, whether one is committed, and
  ``show``;
* :mod:`~s3ckpt.catalog.removal`: ``rm`` (manifest first, then exactly the objects it
  lists; the versions those deletes leave, by id);
* :mod:`~s3ckpt.catalog.pruning`: ``prune``, a retention policy applied;
* :mod:`~s3ckpt.catalog.ownership`: which committed directories are s3ckpt's, for all of
  them.
"""

from __future__ import annotations

from s3ckpt.catalog.committed import (
    acommitted_names,
    ais_committed,
    committed_names,
    is_committed,
    show_checkpoint,
)
from s3ckpt.catalog.listing import SILENT_S, CheckpointInfo, alist_checkpoints, list_checkpoints
from s3ckpt.catalog.pruning import PruneReport, aprune, prune
from s3ckpt.catalog.removal import Removed, aremove_checkpoint, remove_checkpoint, remove_groups

__all__ = [
    "SILENT_S",
    "CheckpointInfo",
    "PruneReport",
    "Removed",
    "acommitted_names",
    "ais_committed",
    "alist_checkpoints",
    "aprune",
    "aremove_checkpoint",
    "committed_names",
    "is_committed",
    "list_checkpoints",
    "prune",
    "remove_checkpoint",
    "remove_groups",
    "show_checkpoint",
]
