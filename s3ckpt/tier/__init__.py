"""The memory tier: recent checkpoints held in shared memory on each node, in front of S3.

A failure costs the steps since the last checkpoint plus the restart; both shrink when
checkpoints are cheap to take often and fast to restore. With a
:class:`~s3ckpt.tier.options.MemoryTier`, every save of a
:class:`~s3ckpt.CheckpointManager` keeps its copy in shared memory that outlives the
training process (a tmpfs, ``/dev/shm`` by default), and every ``s3_every``-th step is
also written to S3 from the same memory: the copy the upload reads *is* the held
checkpoint, so the tier costs no second copy.

* :mod:`~s3ckpt.tier.options`: ``MemoryTier``, what to keep and where, checked at
  construction;
* :mod:`~s3ckpt.tier.copies`: one rank's slots on its node: which to write next, what
  they hold (torch-free, for the CLI);
* :mod:`~s3ckpt.tier.restore`: ``load_latest`` from memory: one agreement across ranks on
  the newest step every rank holds intact, a DCP load from those copies, walking back to
  older ones, then to S3;
* :mod:`~s3ckpt.tier.copy_in`: the load's copies, read from the held files into the model
  and checked against their CRC32Cs as they land;
* :mod:`~s3ckpt.tier.rank`: ``RankTier``, the tier as one rank sees it (slots, peers,
  holds, restores), under the manager and under
* :mod:`~s3ckpt.tier.process`: ``TieredCheckpointProcess``, the same tier for scripts and
  trainers that call ``dcp.async_save`` and name their own S3 checkpoints.

The held copy's own format (segment files, state, descriptor written last) is
:mod:`s3ckpt.background.held`: the checkpoint process writes it.
"""
