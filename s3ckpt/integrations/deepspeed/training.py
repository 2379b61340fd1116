"""What a DeepSpeed training script calls: ``attach``, ``save_checkpoint``,
``load_checkpoint``, ``latest_tag`` (the package's overview: :mod:`s3ckpt.integrations.deepspeed`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from deepspeed import comm as ds_comm
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine

from s3ckpt.config import S3Config
from s3ckpt.errors import (
    CheckpointError,
    ConfigError,
)
from s3ckpt.integrations.deepspeed import compat as compat_deepspeed
from s3ckpt.integrations.deepspeed.engine import (
    ENGINE_NAME,
    LATEST,
    S3CheckpointEngine,
    folder_uri,
)

log = logging.getLogger(__name__)


def attach(
    engine: DeepSpeedEngine,
    *,
    endpoint_url: str | None = None,
    config: S3Config | None = None,
    writer_options: dict[str, Any] | None = None,
    reader_options: dict[str, Any] | None = None,
    trust_pickles: bool = False,
    async_save: bool = False,
    **options: Any,
) -> S3CheckpointEngine:
    """Make ``engine`` (from ``deepspeed.initialize``) save and load ``s3://`` folders
    through s3ckpt; call it on every rank. Arguments as for :class:`S3CheckpointEngine`;
    its group is ``deepspeed.comm.get_world_group()``."""
    if not isinstance(engine, DeepSpeedEngine):
        raise ConfigError(f"attach() needs the engine deepspeed.initialize returns, got {engine!r}")
    current = engine.checkpoint_engine
    if not isinstance(current, (TorchCheckpointEngine, S3CheckpointEngine)):
        raise ConfigError(
            f"this engine saves through {type(current).__name__} (a checkpoint.writer or "
            f"DataStates configuration); {ENGINE_NAME} replaces DeepSpeed's default engine only"
        )
    unsupported = _unsupported(engine)
    if unsupported:
        raise ConfigError(f"{ENGINE_NAME} does not support {', '.join(unsupported)}")
    group = ds_comm.get_world_group()
    if dist.get_world_size(group) != engine.world_size:
        raise ConfigError(
            f"the world group has {dist.get_world_size(group)} ranks, the engine "
            f"{engine.world_size}: every rank of the group must run the engine"
        )
    checkpoints = S3CheckpointEngine(
        group=group,
        endpoint_url=endpoint_url,
        config=config,
        writer_options=writer_options,
        reader_options=reader_options,
        trust_pickles=trust_pickles,
        async_save=async_save,
        **options,
    )
    compat_deepspeed.route_s3_paths(
        engine, checkpoints.files, lambda ce: isinstance(ce, S3CheckpointEngine)
    )
    engine.checkpoint_engine = checkpoints
    return checkpoints


def save_checkpoint(
    engine: DeepSpeedEngine,
    save_dir: str,
    tag: Any = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
) -> bool:
    """``engine.save_checkpoint`` into ``s3://`` ``save_dir`` (every rank), with
    ``latest`` written to S3 after the commit when ``save_latest``."""
    checkpoints = s3_engine(engine)
    folder = folder_uri(save_dir)
    checkpoints.latest_requested = save_latest
    try:
        return bool(
            engine.save_checkpoint(
                folder,
                tag=tag,
                client_state=client_state or {},
                save_latest=False,
                exclude_frozen_parameters=exclude_frozen_parameters,
            )
        )
    finally:
        checkpoints.latest_requested = False


def load_checkpoint(
    engine: DeepSpeedEngine, load_dir: str, tag: Any = None, **options: Any
) -> tuple[str | None, dict[str, Any] | None]:
    """``engine.load_checkpoint`` from ``s3://`` ``load_dir`` (every rank): ``tag``, or
    the one ``<load_dir>/latest`` names; ``(None, None)`` if there is none yet, as
    DeepSpeed returns. ``options``: ``engine.load_checkpoint``'s (``load_optimizer_states``...)."""
    checkpoints = s3_engine(engine)
    folder = folder_uri(load_dir)
    if (
        engine.zero_optimization_partition_weights()
        and not options.get("load_optimizer_states", True)
        and not options.get("load_module_only", False)
    ):
        raise ConfigError(
            "ZeRO-3 with load_optimizer_states=False rebuilds weights from local files "
            "(zero_to_fp32); load the optimizer states too, or pass load_module_only=True"
        )
    if tag is None:
        tag = _shared_latest(checkpoints, folder)
        if tag is None:
            log.warning("no %s under %s: nothing to load", LATEST, folder)
            return None, None
    return engine.load_checkpoint(folder, tag=str(tag), **options)


def latest_tag(save_dir: str, *, config: S3Config | None = None, **options: Any) -> str | None:
    """The tag ``<save_dir>/latest`` names, or ``None`` (from any process, no engine)."""
    return S3CheckpointEngine(group=None, config=config, **options).latest_tag(save_dir)


def s3_engine(engine: Any) -> S3CheckpointEngine:
    """``engine``'s :class:`S3CheckpointEngine`, or a clear error if :func:`attach` was
    not called."""
    checkpoints = getattr(engine, "checkpoint_engine", None)
    if not isinstance(checkpoints, S3CheckpointEngine):
        raise ConfigError(
            f"the engine's checkpoint engine is {type(checkpoints).__name__}: call "
            "s3ckpt.integrations.deepspeed.attach(engine, ...) after deepspeed.initialize"
        )
    return checkpoints


def _shared_latest(checkpoints: S3CheckpointEngine, folder: str) -> str | None:
    """``latest`` read by the group's rank 0 and shared, so every rank loads one tag."""
    group = checkpoints.group
    if group is None or dist.get_world_size(group) == 1:
        return checkpoints.latest_tag(folder)
    found: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            found = [("tag", checkpoints.latest_tag(folder))]
        except Exception as exc:
            dist.broadcast_object_list([("error", str(exc))], group=group, group_src=0)
            raise
    dist.broadcast_object_list(found, group=group, group_src=0)
    kind, value = found[0]
    if kind == "error":
        raise CheckpointError(f"rank 0 could not read {folder}/{LATEST}: {value}")
    return value


def _unsupported(engine: DeepSpeedEngine) -> list[str]:
    """What of ``engine``'s configuration writes files outside the engine's interface."""
    checks = {
        "pipeline parallelism (PipelineEngine)": isinstance(engine, PipelineEngine),
        "MoE layers": bool(engine.has_moe_layers),
        "NVMe optimizer offload": bool(engine.zero_nvme_offload_optimizer()),
        "node-local storage (use_node_local_storage)": bool(engine.use_node_local_storage()),
        "universal checkpoints (load_universal)": bool(engine.load_universal_checkpoint()),
    }
    return [name for name, present in checks.items() if present]
