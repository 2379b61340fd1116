"""PyTorch Lightning and Fabric checkpoints on S3 through s3ckpt.

Two ways in, depending on who writes the checkpoint:

* strategies that save replicated state from rank 0 (single device, DDP; Fabric's too)
  hand every checkpoint to a ``CheckpointIO`` plugin:
  :class:`S3CheckpointIO` (:mod:`~s3ckpt.integrations.lightning.checkpoint_io`), one
  s3ckpt checkpoint per path, optionally wrapped in Lightning's ``AsyncCheckpointIO``;
* sharded strategies bypass ``CheckpointIO`` (every rank calls ``dcp.save`` into a folder,
  and rank 0 writes a ``meta.pt`` beside it): :class:`S3ModelParallelStrategy` (FSDP2 and
  tensor parallelism), :class:`S3FSDPStrategy` (``state_dict_type="sharded"``) and
  Fabric's :class:`S3FabricModelParallelStrategy` save the shards and Lightning's metadata
  as one s3ckpt checkpoint under one manifest (:mod:`~s3ckpt.integrations.lightning.sharded`),
  resumable with ``trainer.fit(ckpt_path="s3://...")``; ``async_save=True`` stages to
  host memory and commits in the background, the previous checkpoint kept until then
  (:mod:`~s3ckpt.integrations.lightning.background`)::

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from s3ckpt.integrations.lightning import S3ModelParallelStrategy, last_checkpoint

    strategy = S3ModelParallelStrategy(endpoint_url="https://flashblade.example.com",
                                       async_save=True)
    trainer = Trainer(strategy=strategy, callbacks=[ModelCheckpoint(dirpath="s3://ckpt/run1")])
    trainer.fit(model, ckpt_path=last_checkpoint("s3://ckpt/run1", config=strategy.s3_config))

Either way ``ModelCheckpoint``'s top-k rotation removes checkpoints through the catalog,
and :func:`last_checkpoint` finds the newest committed one under a prefix
(``fit(ckpt_path="last")`` cannot list ``s3://``). Lightning's private names are used in
:mod:`~s3ckpt.integrations.lightning.compat` alone. Needs the ``lightning`` extra (``pip install './s3ckpt[lightning]'`` from a checkout).
"""

from __future__ import annotations

try:
    import lightning  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised with lightning hidden
    from s3ckpt._install import install_hint

    raise ImportError(
        "s3ckpt.integrations.lightning needs PyTorch Lightning and s3fs, in "
        + install_hint("lightning")
    ) from exc

from s3ckpt.integrations.lightning.checkpoint_io import (
    S3CheckpointIO,
    is_s3,
    last_checkpoint,
    lightning_uri,
)
from s3ckpt.integrations.lightning.fabric import S3FabricModelParallelStrategy
from s3ckpt.integrations.lightning.strategies import S3FSDPStrategy, S3ModelParallelStrategy

__all__ = [
    "S3CheckpointIO",
    "S3FSDPStrategy",
    "S3FabricModelParallelStrategy",
    "S3ModelParallelStrategy",
    "is_s3",
    "last_checkpoint",
    "lightning_uri",
]
