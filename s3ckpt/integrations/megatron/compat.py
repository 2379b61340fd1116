"""Everything the Megatron integration takes from Megatron-core beyond its public API.

Megatron-core (``megatron.core.dist_checkpointing``) offers two seams for storage that
is not a local file system, and s3ckpt uses both, here and nowhere else:

* **Its Multi-Storage Client hook.** Every small file Megatron reads or writes itself
  (``metadata.json``, ``common.pt``, the training loop's tracker file, directory checks)
  goes through ``megatron.core.msc_utils``: when ``MultiStorageClientFeature`` is enabled,
  through the module bound to ``msc_utils.msc`` (``msc.open``, ``msc.Path``,
  ``msc.os.path.*``, ``msc.torch.save``/``load``), and load strategies build their DCP
  reader with ``msc.torch.MultiStorageFileSystemReader``. :func:`install_files` binds
  s3ckpt's file layer there (:mod:`s3ckpt.integrations.megatron.files`) and enables the
  feature; the layer hands every path that is not ``s3://`` to what was bound before
  (the real ``multistorageclient`` where it is installed, else the local file system).
* **The writer of ``TorchDistSaveShardedStrategy.async_save``.** The strategy builds its
  writer from the name ``FileSystemWriterAsync`` of
  ``megatron.core.dist_checkpointing.strategies.torch``; :func:`install_writer_switch`
  binds a subclass there that builds s3ckpt's writer inside :func:`writer_factory` (what
  ``S3SaveShardedStrategy.async_save`` opens around ``super().async_save``, so Megatron's
  plan caching, validation and finalization stay its own) and refuses an ``s3://`` path
  everywhere else, before the local file system writer makes a ``s3:/...`` folder.
  Local paths keep Megatron's writer (told not to use MSC, unless it was enabled before).

Besides: ``core.CONFIG_FNAME``/``CheckpointingConfig`` (the bytes ``save_config`` writes),
``strategies.common.COMMON_STATE_FNAME`` and the ``AsyncRequest`` tuple. Tested against
megatron-core 0.16.1; ``tests/integration/test_megatron.py`` fails when any of these moves.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import megatron.core.dist_checkpointing.strategies.torch as torch_strategies
from megatron.core import msc_utils
from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingConfig
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

from s3ckpt.errors import ConfigError

__all__ = [
    "COMMON_STATE_FNAME",
    "CONFIG_FNAME",
    "AsyncRequest",
    "TorchDistLoadShardedStrategy",
    "TorchDistSaveShardedStrategy",
    "checkpointing_config_json",
    "install_files",
    "install_writer_switch",
    "installed_files",
    "writer_factory",
]

_lock = threading.Lock()
_active = threading.local()  # .factory: the writer factory of the async_save under way


def checkpointing_config_json(backend: str, version: int) -> bytes:
    """The bytes Megatron's ``save_config`` writes to ``metadata.json`` for a strategy."""
    return json.dumps(asdict(CheckpointingConfig(backend, version))).encode()


def install_files(make_files: Callable[[Any, bool], Any]) -> Any:
    """Bind s3ckpt's file layer as Megatron's MSC module (once per process) and enable it.

    ``make_files(previous, previous_enabled)`` builds the layer around what was bound
    before; the layer already bound is returned when called again.
    """
    with _lock:
        current = msc_utils.msc
        feature = msc_utils.MultiStorageClientFeature
        if getattr(current, "is_s3ckpt_files", False):
            feature.enable()  # again: Megatron-LM's argument parsing may have turned it off
            return current
        previous_enabled = current is not None and feature.is_enabled()
        files = make_files(current, previous_enabled)
        msc_utils.msc = files
        feature.enable()
        return files


def installed_files() -> Any | None:
    """s3ckpt's file layer if it is bound as Megatron's MSC module and enabled, else None."""
    current = msc_utils.msc
    if getattr(current, "is_s3ckpt_files", False) and (
        msc_utils.MultiStorageClientFeature.is_enabled()
    ):
        return current
    return None


class _WriterSwitch(FileSystemWriterAsync):
    """What ``TorchDistSaveShardedStrategy.async_save`` builds its writer from once
    :func:`install_writer_switch` ran: s3ckpt's writer inside :func:`writer_factory`,
    a clear error for any other ``s3://`` path, Megatron's writer for local paths."""

    def __new__(cls, path: Any, *args: Any, **kwargs: Any) -> Any:
        factory = getattr(_active, "factory", None)
        if factory is not None:
            return factory(path)
        if str(path).startswith("s3:/"):
            files = installed_files()
            if files is not None:
                files.forget(path)  # the common.pt Megatron wrote for this save
            raise ConfigError(
                f"{path} is an s3:// location: Megatron's own TorchDistSaveShardedStrategy "
                "writes local files only; save with "
                "s3ckpt.integrations.megatron.S3SaveShardedStrategy"
            )
        return super().__new__(cls)

    def __init__(self, path: Any, *args: Any, **kwargs: Any) -> None:
        files = installed_files()
        if files is not None and kwargs.get("use_msc"):
            # MSC is on for s3ckpt's files only: local data files stay on local paths
            # unless the real multistorageclient was enabled before.
            kwargs["use_msc"] = files.previous_enabled
        super().__init__(path, *args, **kwargs)


def install_writer_switch() -> None:
    """Bind :class:`_WriterSwitch` as the writer class of Megatron's torch_dist strategy."""
    with _lock:
        if torch_strategies.FileSystemWriterAsync is not _WriterSwitch:
            torch_strategies.FileSystemWriterAsync = _WriterSwitch


@contextmanager
def writer_factory(factory: Callable[[Any], Any]) -> Iterator[None]:
    """Within the block, the torch_dist strategy's writer on this thread is ``factory(path)``."""
    install_writer_switch()
    _active.factory = factory
    try:
        yield
    finally:
        _active.factory = None
