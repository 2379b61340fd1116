"""The catalog: list, show, verify, prune, garbage-collect and remove checkpoints. No torch.

Everything here works from manifests and listings alone, so the ``s3ckpt`` command and
scripts manage checkpoints without importing torch. One module per operation:

* :mod:`~s3ckpt.catalog.api`: the functions scripts and the CLI call (sync and ``a``-async),
  from :mod:`~s3ckpt.catalog.listing` (``ls``), :mod:`~s3ckpt.catalog.committed` (committed
  names, ``show``), :mod:`~s3ckpt.catalog.removal` (``rm``) and
  :mod:`~s3ckpt.catalog.pruning`; :mod:`~s3ckpt.catalog.ownership`: which committed
  directories are s3ckpt's;
* :mod:`~s3ckpt.catalog.scan`: one listing of a prefix, grouped by checkpoint;
* :mod:`~s3ckpt.catalog.retention`: which checkpoints a retention policy deletes (pure);
* :mod:`~s3ckpt.catalog.steps`, :mod:`~s3ckpt.catalog.run_listing`: how steps are named,
  and the steps under a run, for every reader of steps;
* :mod:`~s3ckpt.catalog.verify`: re-read a checkpoint and check every size and CRC32C;
* :mod:`~s3ckpt.catalog.gc`: leftovers of failed saves, after a grace period;
* :mod:`~s3ckpt.catalog.grace`: ``gc``'s grace periods;
* :mod:`~s3ckpt.catalog.doctor`: what a store supports, probed (``s3ckpt doctor``);
* :mod:`~s3ckpt.catalog.reporting`: the progress protocol long operations report to.
"""

from typing import TYPE_CHECKING

from s3ckpt._lazy import lazy_attributes

if TYPE_CHECKING:
    from s3ckpt.catalog.committed import (
        acommitted_names,
        ais_committed,
        committed_names,
        is_committed,
        show_checkpoint,
    )
    from s3ckpt.catalog.gc import AbortedUpload, Garbage, GcReport, collect_garbage
    from s3ckpt.catalog.listing import CheckpointInfo, alist_checkpoints, list_checkpoints
    from s3ckpt.catalog.pruning import PruneReport, aprune, prune
    from s3ckpt.catalog.removal import Removed, aremove_checkpoint, remove_checkpoint
    from s3ckpt.catalog.retention import Decision
    from s3ckpt.catalog.run_listing import RunSteps, run_steps
    from s3ckpt.catalog.verify import Problem, VerifyReport, verify_checkpoint

# Resolved on first use: the S3 stack behind them takes a while to import, and the CLI
# parses its arguments (and answers --help) without it.
_LAZY = {
    **dict.fromkeys(
        ("CheckpointInfo", "alist_checkpoints", "list_checkpoints"), "s3ckpt.catalog.listing"
    ),
    **dict.fromkeys(
        ("acommitted_names", "ais_committed", "committed_names", "is_committed", "show_checkpoint"),
        "s3ckpt.catalog.committed",
    ),
    **dict.fromkeys(("PruneReport", "aprune", "prune"), "s3ckpt.catalog.pruning"),
    **dict.fromkeys(
        ("Removed", "aremove_checkpoint", "remove_checkpoint"), "s3ckpt.catalog.removal"
    ),
    **dict.fromkeys(
        ("AbortedUpload", "Garbage", "GcReport", "collect_garbage"), "s3ckpt.catalog.gc"
    ),
    "Decision": "s3ckpt.catalog.retention",
    **dict.fromkeys(("RunSteps", "run_steps"), "s3ckpt.catalog.run_listing"),
    **dict.fromkeys(("Problem", "VerifyReport", "verify_checkpoint"), "s3ckpt.catalog.verify"),
}


__getattr__ = lazy_attributes(__name__, _LAZY, globals())


__all__ = [
    "AbortedUpload",
    "CheckpointInfo",
    "Decision",
    "Garbage",
    "GcReport",
    "Problem",
    "PruneReport",
    "Removed",
    "RunSteps",
    "VerifyReport",
    "acommitted_names",
    "ais_committed",
    "alist_checkpoints",
    "aprune",
    "aremove_checkpoint",
    "collect_garbage",
    "committed_names",
    "is_committed",
    "list_checkpoints",
    "prune",
    "remove_checkpoint",
    "run_steps",
    "show_checkpoint",
    "verify_checkpoint",
]
