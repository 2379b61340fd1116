"""The Trainer's sharded strategies over s3ckpt: ``S3ModelParallelStrategy`` and
``S3FSDPStrategy``.

Each is Lightning's strategy with its checkpoint methods replaced for ``s3://`` paths
(:mod:`s3ckpt.integrations.lightning.sharded`): ``save_checkpoint`` writes the model and
optimizer shards and Lightning's metadata as one s3ckpt checkpoint, ``load_checkpoint``
restores them as Lightning's own method does from its folder, ``remove_checkpoint``
deletes through the catalog, and ``teardown`` waits for a save still in flight. The
strategy's own arguments pass through unchanged (keyword arguments); the s3ckpt ones:

* ``endpoint_url``, ``config``, ``s3_options``: the store (:class:`~s3ckpt.config.S3Config`
  fields in ``s3_options``); ``configure_fsspec`` points s3fs at it for ``ModelCheckpoint``;
* ``writer_options`` / ``reader_options``: for every ``S3StorageWriter`` / ``S3StorageReader``;
  ``trainer.save_checkpoint(..., storage_options=...)`` overrides the writer's for one save;
* ``async_save``: saves return once the state is in host memory and commit in the
  background (:mod:`s3ckpt.integrations.lightning.background`).

Loading a local folder falls back to Lightning's own format; saving to one is refused.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from s3ckpt.config import S3Config, make_config
from s3ckpt.errors import ConfigError
from s3ckpt.integrations.fsspec_s3 import configure_fsspec as point_fsspec_at
from s3ckpt.integrations.lightning.checkpoint_io import is_s3
from s3ckpt.integrations.lightning.compat import inner_optimizer, sharded_state_dict_context
from s3ckpt.integrations.lightning.sharded import ShardedCheckpoints

log = logging.getLogger(__name__)

_Path = str | os.PathLike[str]


class _S3Sharded:
    """What both strategies add to Lightning's: the store, removals and teardown. Its
    keywords are s3ckpt's (the module's docstring); the others go to Lightning's strategy,
    once :meth:`_check_options` has refused those s3ckpt cannot honour."""

    checkpoints: ShardedCheckpoints

    def __init__(
        self,
        *,
        endpoint_url: str | None = None,
        config: S3Config | None = None,
        s3_options: dict[str, Any] | None = None,
        writer_options: dict[str, Any] | None = None,
        reader_options: dict[str, Any] | None = None,
        async_save: bool = False,
        configure_fsspec: bool = True,
        **kwargs: Any,
    ) -> None:
        self._check_options(kwargs)
        super().__init__(**kwargs)
        self.s3_config = make_config(config, endpoint_url=endpoint_url, **(s3_options or {}))
        if configure_fsspec:
            point_fsspec_at(self.s3_config)
        self.checkpoints = ShardedCheckpoints(
            self.s3_config,
            writer_options=writer_options,
            reader_options=reader_options,
            async_save=async_save,
        )

    def _check_options(self, options: dict[str, Any]) -> None:
        """Refuse (``ConfigError``) or complete Lightning's keyword arguments."""

    def remove_checkpoint(self, filepath: _Path) -> None:
        """Rank 0 removes ``filepath`` through the catalog (after the save in flight)."""
        if not self.is_global_zero:  # type: ignore[attr-defined]
            return
        if not is_s3(filepath):
            super().remove_checkpoint(filepath)  # type: ignore[misc]
            return
        self.checkpoints.remove(filepath)

    def _save_shards(
        self, model_key: str, checkpoint: dict[str, Any], filepath: _Path, storage_options: Any
    ) -> None:
        """Lightning's checkpoint dict as one checkpoint: the model's shards under
        ``model_key``, each optimizer's as ``optimizer_<i>``, the rest (``meta.pt``'s
        content) from rank 0; every rank saves at rank 0's path."""
        path = self.broadcast(os.fspath(filepath))  # type: ignore[attr-defined]
        shards = {model_key: checkpoint.pop("state_dict")}
        for index, state in enumerate(checkpoint.pop("optimizer_states", [])):
            shards[f"optimizer_{index}"] = state
        metadata = checkpoint if self.is_global_zero else None  # type: ignore[attr-defined]
        self.checkpoints.save(shards, metadata, path, storage_options)

    def teardown(self) -> None:
        """Wait for the save in flight; its failure is raised unless another error is."""
        handling = sys.exc_info()[1]
        try:
            self.checkpoints.close()
        except BaseException:  # DCP's CheckpointException is a BaseException
            if handling is None:
                raise
            log.error("the checkpoint save in flight failed as well", exc_info=True)
        finally:
            super().teardown()  # type: ignore[misc]


class S3ModelParallelStrategy(_S3Sharded, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallelism) saving sharded
    checkpoints to ``s3://`` paths as s3ckpt checkpoints; arguments as in the module
    docstring, Lightning's by keyword."""

    def _check_options(self, options: dict[str, Any]) -> None:
        if options.get("save_distributed_checkpoint", True) is not True:
            raise ConfigError(
                "S3ModelParallelStrategy saves sharded checkpoints only; "
                "save_distributed_checkpoint=False (the full state gathered on rank 0) "
                "is not supported"
            )

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's shards; left on the device for an async save, which stages them."""
        if not self.checkpoints.async_save:
            return super().lightning_module_state_dict()
        return get_model_state_dict(self.model, options=StateDictOptions())

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's shards; left on the device for an async save, as the model's."""
        if not self.checkpoints.async_save:
            return super().optimizer_state(optimizer)
        return get_optimizer_state_dict(
            self.model, inner_optimizer(optimizer), options=StateDictOptions()
        )

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _Path, storage_options: Any | None = None
    ) -> None:
        self._save_shards("state_dict", checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: _Path, weights_only: bool | None = None) -> Any:
        if not is_s3(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        path = self.broadcast(os.fspath(checkpoint_path))
        self.checkpoints.wait()
        assert self.model is not None and self.lightning_module is not None
        module = self.model
        optimizers = {f"optimizer_{i}": opt for i, opt in enumerate(self.optimizers)}
        templates: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
        for key, optimizer in optimizers.items():
            templates[key] = get_optimizer_state_dict(module, optimizer)
        metadata = self.checkpoints.load(templates, path, weights_only)
        module.load_state_dict(templates["state_dict"], strict=self.lightning_module.strict_loading)
        for key, optimizer in optimizers.items():
            set_optimizer_state_dict(
                module, optimizer, optim_state_dict=templates[key],
                options=StateDictOptions(cpu_offload=True),
            )  # fmt: skip
        return metadata


class S3FSDPStrategy(_S3Sharded, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` with sharded state dicts, saving to ``s3://`` paths
    as s3ckpt checkpoints; arguments as in the module docstring, Lightning's by keyword
    (``state_dict_type`` is ``"sharded"``, the only one accepted)."""

    def _check_options(self, options: dict[str, Any]) -> None:
        state_dict_type = options.setdefault("state_dict_type", "sharded")
        if state_dict_type != "sharded":
            raise ConfigError(
                f"S3FSDPStrategy saves sharded checkpoints only, got state_dict_type="
                f"{state_dict_type!r} (the full state gathered on rank 0) is not supported"
            )

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _Path, storage_options: Any | None = None
    ) -> None:
        self._save_shards("model", checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: _Path, weights_only: bool | None = None) -> Any:
        if not is_s3(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        path = self.broadcast(os.fspath(checkpoint_path))
        self.checkpoints.wait()
        assert self.model is not None and self.lightning_module is not None
        model = self.model
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        with sharded_state_dict_context(model):
            templates = {"model": model.state_dict()}
            metadata = self.checkpoints.load(templates, path, weights_only)
            model.load_state_dict(templates["model"], strict=self.lightning_module.strict_loading)
            if fitting and self.optimizers:
                reader = self.checkpoints.reader(path)
                for index, optimizer in enumerate(self.optimizers):
                    key = f"optimizer_{index}"
                    stored = load_sharded_optimizer_state_dict(
                        model_state_dict=templates["model"], optimizer_key=key,
                        storage_reader=reader,
                    )  # fmt: skip
                    optimizer.load_state_dict(
                        FSDP.optim_state_dict_to_load(
                            optim_state_dict=stored[key], model=model, optim=optimizer
                        )
                    )
        return metadata
