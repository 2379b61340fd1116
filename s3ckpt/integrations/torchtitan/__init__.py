"""torchtitan checkpoints on S3 through s3ckpt: ``S3CheckpointManager``.

torchtitan's ``CheckpointManager`` (``torchtitan.components.checkpointer``) saves
``step-N`` checkpoints with DCP and takes custom storage by subclassing: ``dcp_save`` and
``dcp_load`` pick the storage writer and reader, ``_find_load_step`` discovers the steps
(it looks for ``step-N/.metadata``, a FileSystemWriter file that an s3ckpt checkpoint does
not have: its commit is ``step-N/manifest.json``), ``_purge_stale_checkpoints`` applies
``keep_latest_k``. This subclass overrides exactly those, for an ``s3://`` folder:

* saves go through :class:`~s3ckpt.S3StorageWriter` in each of torchtitan's async modes
  (``disabled``: ``dcp.save``; ``async`` and ``async_with_pinned_mem``: the rank's
  :class:`~s3ckpt.CheckpointProcess`, which uploads from host memory shared with the
  trainer, pinned with CUDA, so the training loop's interpreter does nothing for the
  upload; it meets the other ranks on torchtitan's gloo group); saving a step again
  replaces it atomically, as the file system version overwrites;
* loads go through :class:`~s3ckpt.S3StorageReader`;
* the latest step is the highest *committed* ``step-N`` (a save killed half-way is never
  picked); any ``step-<digits>`` name is a step (:func:`s3ckpt.step_of`), so steps that
  ``s3ckpt.CheckpointManager`` wrote (``step-0000000300``) are found and loaded too, and a
  step named both ways is read from the padded name (logged);
* retention, after each save but the last (as torchtitan does), keeps the ``keep_latest_k``
  newest steps, the one just saved (committed or still uploading) included, and deletes
  the older committed ones through the catalog (manifest first) on torchtitan's purge
  thread.

* the last step (``last_save_model_only``, torchtitan's default) holds the model alone, in
  ``export_dtype``: it is committed as ``step-N`` like the others but is no point to resume
  from, so discovery skips it (its stored names hold no state but the model's) and picks
  the newest step that holds the whole training state;
* with ``last_save_in_hf`` (which torchtitan refuses for a remote folder), the last step is
  written as Hugging Face safetensors under ``step-N``: the model, named and laid out by
  torchtitan's state-dict adapter (``sd_adapter.to_hf``; the shards of its
  ``fqn_to_index_mapping``, read from ``model.safetensors.index.json`` in
  ``hf_assets_path``, else one ``model.safetensors``), is saved by every rank as an s3ckpt
  checkpoint at ``step-N.hf-source`` and exported from there by rank 0 with
  :func:`s3ckpt.interop.export.export_checkpoint` (as ``s3ckpt export`` does: whole
  tensors whatever the parallelism, every byte checked), with ``config.json`` and
  ``generation_config.json`` from ``hf_assets_path`` when it has them. The index,
  ``model.safetensors.index.json``, is written last; an export that fails removes what it
  wrote, keeps ``step-N.hf-source`` and fails the save on every rank; one that succeeds
  removes ``step-N.hf-source``. ``step-N`` then holds safetensors, not an s3ckpt
  checkpoint: neither is a resume point.

* with ``memory_tier`` (the keywords of :class:`s3ckpt.MemoryTier`; an async mode), every
  interval save is held in shared memory on its node (and replicated to a peer node), and
  only the steps ``s3_every`` divides are also written to S3, from the same memory
  (:class:`~s3ckpt.TieredCheckpointProcess`); a restart (``load()`` of the latest step)
  restores the newest step the whole job holds intact in memory when it is at least the
  newest resumable S3 step, agreed across ranks, and from S3 otherwise; ``last_restore``
  says which. Retention (``keep_latest_k``) counts the S3 steps alone; the tier keeps its
  own ``keep``.

Loads of HF safetensors and local paths (``initial_load_path``) stay torchtitan's.
torchtitan checks that the folder exists through fsspec, i.e. s3fs: the manager points
s3fs at the same endpoint (``configure_fsspec``), so s3fs must be installed. Select it in
the trainer's configuration::

    from s3ckpt.integrations.torchtitan import S3CheckpointManager

    config.checkpoint = S3CheckpointManager.Config(
        enable=True, folder="s3://ckpt/llama3-8b", interval=500, keep_latest_k=3,
        async_mode="async", endpoint_url="https://flashblade.example.com",
        writer_options={"compression": "zstd"},
        memory_tier={"keep": 2, "s3_every": 5000},  # optional: hold every save in memory
        last_save_model_only=True, last_save_in_hf=True, export_dtype="bfloat16")

Credentials come from the AWS environment or a profile (``s3_options={"profile": ...}``),
never from the configuration, which torchtitan logs.

One module per part: :mod:`~s3ckpt.integrations.torchtitan.manager` (the
``CheckpointManager`` subclass: its storage hooks, discovery and retention),
:mod:`~s3ckpt.integrations.torchtitan.hf_export` (the last step as safetensors),
:mod:`~s3ckpt.integrations.torchtitan.async_modes` (what each async mode hands back) and
:mod:`~s3ckpt.integrations.torchtitan.options` (the configuration's own checks).
"""

from s3ckpt.integrations.torchtitan.hf_export import HF_CONFIG_FILES, HF_SOURCE
from s3ckpt.integrations.torchtitan.manager import S3CheckpointManager
from s3ckpt.integrations.torchtitan.options import memory_tier_of

__all__ = ["HF_CONFIG_FILES", "HF_SOURCE", "S3CheckpointManager", "memory_tier_of"]
