"""Megatron-core ``dist_checkpointing`` on S3 through s3ckpt (Megatron-LM, NeMo, Megatron-Bridge).

Saving: :class:`S3SaveShardedStrategy`, a ``TorchDistSaveShardedStrategy`` (the class
Megatron-LM's training loop keeps in ``checkpointing_context["save_strategy"]`` and
reuses for every save) whose writer is :class:`MegatronS3Writer`, an
:class:`~s3ckpt.S3StorageWriter` with the interface of Megatron's async writer. Megatron's
planning, its plan and metadata caching (``--ckpt-assume-constant-structure``), its
validation and its finalization all stay Megatron's: only the writer changes
(:func:`~s3ckpt.integrations.megatron.compat.writer_factory`). Synchronous saves
(``dist_checkpointing.save``), asynchronous ones (``async_sharded_save=True`` returns an
``AsyncRequest`` for Megatron's ``AsyncCallsQueue``: the write runs in its forked or
persistent worker, the commit in the finalization on the trainer) and
``FullyParallelSaveStrategyWrapper`` around the strategy all work::

    from megatron.core import dist_checkpointing
    from s3ckpt.integrations.megatron import S3LoadShardedStrategy, S3SaveShardedStrategy

    strategy = S3SaveShardedStrategy(endpoint_url="https://flashblade.example.com")
    dist_checkpointing.save(sharded_state_dict, "s3://ckpt/gpt/iter_0000100",
                            sharded_strategy=strategy)
    state = dist_checkpointing.load(sharded_state_dict, "s3://ckpt/gpt/iter_0000100",
                                    sharded_strategy=S3LoadShardedStrategy())

In Megatron-LM, create the strategies after it has parsed its arguments (it turns
Megatron's Multi-Storage Client feature off then, unless ``--enable-msc``; a save or load
that finds it off raises :class:`~s3ckpt.errors.ConfigError`), set
``checkpointing_context["save_strategy"]`` before the first save
(``--ckpt-assume-constant-structure`` then applies as to its own strategy:
``strategy.use_cached_ckpt_structure = True``) and point ``--save``/``--load`` at an
``s3://`` prefix.

Loading: Megatron builds its DCP reader in ``strategies.torch._get_filesystem_reader``,
which, with Megatron's Multi-Storage Client feature on, asks
``msc.torch.MultiStorageFileSystemReader``: s3ckpt's file layer
(:mod:`s3ckpt.integrations.megatron.files`) answers that with an
:class:`~s3ckpt.S3StorageReader` for ``s3://`` paths. That is the documented way in
(Megatron's own route to object storage; the same hook serves its small files), so any
``TorchDistLoadShardedStrategy`` loads an ``s3://`` checkpoint once the layer is enabled,
Megatron's default among them. :class:`S3LoadShardedStrategy` (pass it as
``sharded_strategy=`` to ``dist_checkpointing.load``) enables it with its configuration,
shares the manifest and metadata read over the loading ranks (``dist_checkpointing.load``
is collective) and keeps s3ckpt's items out of Megatron's listing of a checkpoint's
objects. Patching ``_get_filesystem_reader`` itself would be more fragile: it is a
private function whose signature changed between releases, while the MSC hook is what
Megatron documents and keeps for object storage.

Megatron's own files: ``common.pt`` and ``metadata.json`` are items of the s3ckpt
checkpoint, committed by its manifest with the tensors; the tracker
``latest_checkpointed_iteration.txt`` is an object beside the steps, written only when
the step it names is committed (:mod:`~s3ckpt.integrations.megatron.files`). Nothing of an
``s3://`` path reaches the local disk: Megatron's own ``TorchDistSaveShardedStrategy``
given one raises :class:`~s3ckpt.errors.ConfigError` once this module is imported.

One S3 configuration per process: the file layer uses the one the latest strategy (or
:func:`enable`) was created with. Tensors on the GPU are copied to host memory when the
async request is scheduled (``preload_fn``), as Megatron's writer does; CPU tensors are
not copied (a forked worker sees them as they were at the fork).
"""

from __future__ import annotations

from s3ckpt.integrations.megatron.strategies import (
    MegatronS3Writer,
    S3LoadShardedStrategy,
    S3SaveShardedStrategy,
    enable,
)

__all__ = [
    "MegatronS3Writer",
    "S3LoadShardedStrategy",
    "S3SaveShardedStrategy",
    "enable",
]
