"""The last step as Hugging Face safetensors on S3 (``last_save_in_hf``): the export of
the model's s3ckpt checkpoint (``step-N`` + :data:`HF_SOURCE`) by rank 0, with the
configuration files of torchtitan's Hugging Face assets folder."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from s3ckpt import catalog
from s3ckpt.config import S3Config
from s3ckpt.errors import CheckpointError, S3CkptError
from s3ckpt.interop.export import export_checkpoint

log = logging.getLogger("s3ckpt.integrations.torchtitan")

HF_SOURCE = ".hf-source"  # step-N + this: the model an HF export at step-N is written from
HF_CONFIG_FILES = ("config.json", "generation_config.json")  # copied from hf_assets_path


def export_to_hf(
    source: str, out: str, mapping: Mapping[Any, int] | None, sd_adapter: Any, config: S3Config
) -> None:
    """Export the s3ckpt checkpoint at ``source`` into ``out`` as Hugging Face safetensors
    (sharded as ``mapping`` says, with the adapter's configuration files), then remove
    ``source``; a failed export raises :class:`~s3ckpt.errors.CheckpointError`."""
    try:
        export_checkpoint(
            source,
            out,
            format="safetensors",
            overwrite=True,  # as torchtitan's file system save writes over a folder
            shard_of={str(k): int(v) for k, v in mapping.items()} if mapping else None,
            files=hf_config_files(sd_adapter),
            config=config,
        )
    except Exception as exc:
        raise CheckpointError(
            f"the Hugging Face export of {source} into {out} failed (what it wrote "
            f"there is removed); the model stays saved at {source}: {exc}"
        ) from exc
    log.info("saved the model as Hugging Face safetensors at %s", out)
    try:
        catalog.remove_checkpoint(source, config=config)
    except S3CkptError as exc:  # the export is whole: the run need not fail for this
        log.warning("could not remove %s (s3ckpt rm removes it): %s", source, exc)


def hf_config_files(sd_adapter: Any) -> dict[str, bytes]:
    """The model's configuration from torchtitan's Hugging Face assets folder, if local."""
    folder = getattr(sd_adapter, "hf_assets_path", None)
    if not folder or "://" in str(folder):
        return {}
    paths = (Path(folder) / name for name in HF_CONFIG_FILES)
    return {path.name: path.read_bytes() for path in paths if path.is_file()}


def on_rank_zero(action: Callable[[], None]) -> None:
    """Run ``action`` on rank 0 alone; every rank raises if it failed there, so that no
    rank goes on believing the save done."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    failure: Exception | None = None
    if rank == 0:
        try:
            action()
        except Exception as exc:
            failure = exc
    if dist.is_initialized() and dist.get_world_size() > 1:
        outcome = [None if failure is None else str(failure)]
        dist.broadcast_object_list(outcome, src=0)
        if failure is None and outcome[0] is not None:
            raise CheckpointError(f"rank 0 failed to save the last step: {outcome[0]}")
    if failure is not None:
        raise failure
