"""``CheckpointManager``: the training-loop front end over DCP and the catalog.

* :mod:`~s3ckpt.manager.checkpoint_manager`: the facade and its lifecycle (open,
  ``prepare``, ``wait``, ``close``), composing the two paths below;
* :mod:`~s3ckpt.manager.saving`: saves in the background, one in flight, failures raised
  on the next call (:mod:`~s3ckpt.manager.ledger` records each save as it ends);
* :mod:`~s3ckpt.manager.loading`: loading a step, or the latest from memory or S3;
* :mod:`~s3ckpt.manager.policy`: checkpoint names, options, metrics;
* :mod:`~s3ckpt.manager.memory_tier`: the manager's memory tier, wired to its saves and loads;
* :mod:`~s3ckpt.manager.committed`: which steps are committed, at little cost.

The few collectives its decisions need are :mod:`s3ckpt.background.ranks`'s.

The upload itself, and the retention after each commit
(:mod:`s3ckpt.catalog.run_retention`), run in :mod:`s3ckpt.background` (the checkpoint
process by default).
"""

from s3ckpt.manager.checkpoint_manager import CheckpointManager
from s3ckpt.manager.policy import SaveMetrics

__all__ = ["CheckpointManager", "SaveMetrics"]
