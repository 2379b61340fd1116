"""Fabric's ``ModelParallelStrategy`` over s3ckpt: ``S3FabricModelParallelStrategy``.

``fabric.save(path, state)`` with Fabric's ``ModelParallelStrategy`` writes a DCP folder
and ``meta.pt`` (:mod:`s3ckpt.integrations.lightning.sharded`); this subclass writes an
``s3://`` path as one s3ckpt checkpoint instead, and ``fabric.load(path, state)`` restores
from it as Fabric does from its folder: the model's and optimizers' shards in place, the
requested other entries (``Stateful`` objects through ``load_state_dict``), and the rest
returned. Saves are synchronous. Fabric's other strategies (single device, DDP) save
through a ``CheckpointIO``: ``Fabric(plugins=[S3CheckpointIO()])``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from s3ckpt.config import S3Config, make_config
from s3ckpt.errors import ConfigError
from s3ckpt.integrations.lightning.checkpoint_io import is_s3
from s3ckpt.integrations.lightning.compat import check_requested_keys
from s3ckpt.integrations.lightning.sharded import ShardedCheckpoints


class S3FabricModelParallelStrategy(ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` saving ``s3://`` paths as s3ckpt checkpoints.

    Fabric's arguments (``parallelize_fn``...) by keyword; ``endpoint_url``, ``config``,
    ``s3_options``, ``writer_options`` and ``reader_options`` as for the Trainer's
    :class:`~s3ckpt.integrations.lightning.S3ModelParallelStrategy`.
    """

    def __init__(
        self,
        *,
        endpoint_url: str | None = None,
        config: S3Config | None = None,
        s3_options: dict[str, Any] | None = None,
        writer_options: dict[str, Any] | None = None,
        reader_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("save_distributed_checkpoint", True) is not True:
            raise ConfigError(
                "S3FabricModelParallelStrategy saves sharded checkpoints only; "
                "save_distributed_checkpoint=False is not supported"
            )
        super().__init__(**kwargs)
        self.s3_config = make_config(config, endpoint_url=endpoint_url, **(s3_options or {}))
        self.checkpoints = ShardedCheckpoints(
            self.s3_config, writer_options=writer_options, reader_options=reader_options
        )

    def save_checkpoint(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: Any | None = None,
    ) -> None:
        if filter is not None:
            raise ConfigError("sharded checkpoints are saved whole: filter is not supported")
        path = self.broadcast(os.fspath(path))
        module = _the_module(state)
        options = StateDictOptions(cpu_offload=True)
        shards: dict[str, Any] = {}
        metadata: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, torch.nn.Module):
                shards[key] = get_model_state_dict(obj, options=options)
            elif isinstance(obj, torch.optim.Optimizer):
                shards[key] = get_optimizer_state_dict(module, obj, options=options)
            else:  # everything else is Fabric's metadata, as in meta.pt
                metadata[key] = obj.state_dict() if isinstance(obj, Stateful) else obj
        self.checkpoints.save(
            shards, metadata if self.global_rank == 0 else None, path, storage_options
        )

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        state: Any = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if not is_s3(path):
            return super().load_checkpoint(path, state, strict, weights_only)
        if not isinstance(state, dict) or not state:
            raise ConfigError(
                "a sharded checkpoint loads into a dict holding the model: "
                "fabric.load(path, {'model': model, 'optimizer': optimizer, ...})"
            )
        path = self.broadcast(os.fspath(path))
        module = _the_module(state)
        module_key = next(key for key, obj in state.items() if obj is module)
        optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
        templates: dict[str, Any] = {module_key: get_model_state_dict(module)}
        for key, optimizer in optimizers.items():
            templates[key] = get_optimizer_state_dict(module, optimizer)
        metadata = self.checkpoints.load(templates, path, weights_only)
        module.load_state_dict(templates[module_key], strict=strict)
        for key, optimizer in optimizers.items():
            set_optimizer_state_dict(
                module, optimizer, optim_state_dict=templates[key],
                options=StateDictOptions(cpu_offload=True),
            )  # fmt: skip
        requested = state.keys() - {module_key} - optimizers.keys()
        check_requested_keys(requested, metadata.keys(), strict)
        for key in requested & metadata.keys():
            value = metadata.pop(key)
            if isinstance(state[key], Stateful):
                state[key].load_state_dict(value)
            else:
                state[key] = value
        return metadata


def _the_module(state: dict[str, Any]) -> torch.nn.Module:
    """The one distributed (DTensor) model in ``state``, as Fabric requires."""
    modules = [
        obj
        for obj in state.values()
        if isinstance(obj, torch.nn.Module)
        and any(isinstance(p, DTensor) for p in obj.parameters())
    ]
    if len(modules) != 1:
        raise ConfigError(
            f"a sharded checkpoint holds exactly one distributed model, found {len(modules)} "
            "in the state: set the model up with fabric.setup and pass it as "
            "{'model': model, ...}"
        )
    return modules[0]
