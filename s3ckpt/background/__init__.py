"""The background saver: what runs a save's upload while the training loop goes on.

* :mod:`~s3ckpt.background.saver`: ``BackgroundSaver``, the one saver under
  :class:`~s3ckpt.CheckpointManager` and the integrations: one save in flight, the copy's
  memory kept from save to save, the upload in the checkpoint process or on a thread;
* :mod:`~s3ckpt.background.process`: ``CheckpointProcess``, the persistent checkpoint
  process of one rank (also what ``dcp.async_save`` users pass their saves to);
* :mod:`~s3ckpt.background.trainer_side`: the trainer's side of one started checkpoint
  process (runs in the trainer);
* :mod:`~s3ckpt.background.meeting`: the trainers' watch over their processes' meeting;
* :mod:`~s3ckpt.background.priority`: when other work fills the cores, so a process saving
  at a lowered priority gets the trainer's back;
* :mod:`~s3ckpt.background.protocol`: the typed messages between a trainer and its
  checkpoint process, and their order;
* :mod:`~s3ckpt.background.process_side`: the checkpoint process's side (runs in it);
* :mod:`~s3ckpt.background.held`, :mod:`~s3ckpt.background.replicate`: the memory tier's
  held copies (their files, their checks) and the exchange of copies between nodes;
* :mod:`~s3ckpt.background.arena`, :mod:`~s3ckpt.background.arena_copy`,
  :mod:`~s3ckpt.background.shards`: the shared staging memory, the copy into it, and
  sharded tensors saved without their mesh;
* :mod:`~s3ckpt.background.channel`: messages, descriptors and staged state between the
  two processes;
* :mod:`~s3ckpt.background.ranks`: the ranks a manager or a tiered process agrees with,
  and the few collectives their decisions need.
"""
