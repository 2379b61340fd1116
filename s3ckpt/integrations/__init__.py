"""s3ckpt inside the trainers people already run. Each integration imports its trainer
only when it is imported itself, so ``import s3ckpt`` never needs one. An integration of
several modules is a package of one shape: its ``__init__`` gives the overview and the
public names, one module per part, and ``compat.py`` for the trainer's internals:

* :mod:`~s3ckpt.integrations.lightning`: ``S3CheckpointIO``, PyTorch Lightning's checkpoint
  plugin (``pip install './s3ckpt[lightning]'``);
* :mod:`~s3ckpt.integrations.torchtitan`: ``S3CheckpointManager``, torchtitan's checkpoint
  manager saving, discovering, retaining and loading ``step-N`` through s3ckpt
  (``pip install './s3ckpt[torchtitan]'``);
* :mod:`~s3ckpt.integrations.megatron`: ``S3SaveShardedStrategy`` and
  ``S3LoadShardedStrategy``, Megatron-core's ``dist_checkpointing`` strategies over s3ckpt,
  with Megatron's own files through :mod:`~s3ckpt.integrations.megatron.files`
  (``pip install './s3ckpt[megatron]'``);
* :mod:`~s3ckpt.integrations.deepspeed`: ``S3CheckpointEngine``, DeepSpeed's checkpoint
  engine, one s3ckpt checkpoint per tag with ``latest`` in S3 (``pip install
  './s3ckpt[deepspeed]'``; DeepSpeed's internals in :mod:`~s3ckpt.integrations.deepspeed.compat`);
* :mod:`~s3ckpt.integrations.torch_checkpointing`: ``S3Storage`` and ``manager_config``,
  torch-checkpointing's storage on S3, each save committed by an s3ckpt manifest
  (``pip install './s3ckpt[torch-checkpointing]'``);
* :mod:`~s3ckpt.integrations.nested`: a trainer's nested checkpoint dict as one DCP
  checkpoint and back, unchanged;
* :mod:`~s3ckpt.integrations.fsspec_s3`: fsspec's ``s3://`` filesystem (s3fs) pointed at
  the same endpoint, for the directory checks trainers make through fsspec.
"""
