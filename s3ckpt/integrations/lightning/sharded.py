"""Lightning's sharded checkpoints as one s3ckpt checkpoint each: ``ShardedCheckpoints``.

Lightning's sharded strategies (``FSDPStrategy(state_dict_type="sharded")``,
``ModelParallelStrategy``, Fabric's ``ModelParallelStrategy``) bypass ``CheckpointIO``:
every rank calls ``dcp.save(checkpoint_id=folder)`` with its shards of the model and
optimizer states, and rank 0 then writes ``meta.pt`` beside DCP's files, a ``torch.save``
of everything else (loops, callbacks, schedulers, hyper-parameters). Two writes, no
commit: a crash between them leaves a folder that looks like a checkpoint.

Here the same content is one s3ckpt checkpoint. The shards are DCP items written by
every rank through :class:`~s3ckpt.S3StorageWriter`; what ``meta.pt`` would hold is one
bytes item, :data:`META_KEY` (the same ``torch.save`` bytes), added by rank 0 to the same
``dcp.save``. So everything sits under one manifest, committed last: the checkpoint is
there whole or not at all, and saving over one (``last.ckpt``) replaces it atomically.
A load is one ``dcp.load`` through :class:`~s3ckpt.S3StorageReader` of the strategy's own
templates and that item (its manifest and metadata read once, on rank 0, and broadcast);
the metadata comes back through ``torch.load(weights_only=...)``, as Lightning reads
``meta.pt``. Removals go through the catalog (manifest first). With ``async_save`` the
saves run in the background (:mod:`s3ckpt.integrations.lightning.background`).
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from s3ckpt import catalog
from s3ckpt.background.saver import SaverMode
from s3ckpt.config import S3Config
from s3ckpt.dcp.reader import S3StorageReader
from s3ckpt.dcp.writer import S3StorageWriter
from s3ckpt.errors import CheckpointError, CheckpointNotFoundError, ConfigError
from s3ckpt.integrations.lightning.background import BackgroundSaves
from s3ckpt.integrations.lightning.checkpoint_io import is_s3, lightning_uri

log = logging.getLogger(__name__)

META_KEY = "lightning.meta.pt"
"""The DCP item holding what Lightning writes to ``meta.pt``: its ``torch.save`` bytes."""


class ShardedCheckpoints:
    """Saves, loads and removals of sharded checkpoints at ``s3://`` paths, for one
    strategy: every rank calls :meth:`save` and :meth:`load`, rank 0 :meth:`remove`."""

    def __init__(
        self,
        config: S3Config,
        *,
        writer_options: dict[str, Any] | None = None,
        reader_options: dict[str, Any] | None = None,
        async_save: bool = False,
        async_mode: SaverMode = "process",
    ) -> None:
        self.config = config
        self.writer_options = dict(writer_options or {})
        self.reader_options = dict(reader_options or {})
        self.async_save = async_save
        self._background = BackgroundSaves(self._remove, async_mode) if async_save else None

    def save(
        self,
        shards: dict[str, Any],
        metadata: dict[str, Any] | None,
        path: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        """Save ``shards`` (every rank's) and ``metadata`` (rank 0 passes it, the others
        ``None``) as one checkpoint at ``path``; with ``async_save`` it returns once the
        state is in host memory and commits in the background."""
        uri = s3_path(path)
        items = dict(shards)
        if metadata is not None:
            items[META_KEY] = pack_metadata(metadata)
        options = {**self.writer_options, **(storage_options or {})}
        writer = S3StorageWriter(uri, config=self.config, overwrite=True, **options)
        if self._background is not None:
            self._background.start(uri, items, writer)
        else:
            dcp.save(items, storage_writer=writer)

    def load(
        self, templates: dict[str, Any], path: str | os.PathLike[str], weights_only: bool | None
    ) -> dict[str, Any]:
        """Load the shards ``templates`` name into them, in place; returns the metadata."""
        items: dict[str, Any] = {**templates, META_KEY: None}
        dcp.load(items, storage_reader=self.reader(path))
        data = items[META_KEY]
        if not isinstance(data, bytes):
            raise CheckpointError(
                f"{lightning_uri(path)} holds no {META_KEY} item: it was not saved by an "
                "s3ckpt Lightning strategy"
            )
        return unpack_metadata(data, weights_only)

    def reader(self, path: str | os.PathLike[str]) -> S3StorageReader:
        """A reader of ``path`` for a load on every rank of the default group."""
        shared = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
        return S3StorageReader(
            s3_path(path), config=self.config, process_group=shared, **self.reader_options
        )

    def remove(self, path: str | os.PathLike[str]) -> None:
        """Remove the checkpoint at ``path``, once the save in flight (if any) commits."""
        uri = s3_path(path)
        if self._background is not None and self._background.defer_removal(uri):
            log.debug("%s will be removed once the save in flight commits", uri)
            return
        try:
            self._remove(uri)
        except CheckpointNotFoundError:
            log.debug("%s is not there to remove", uri)

    def wait(self) -> None:
        """Wait for the save in flight to commit; raises its failure."""
        if self._background is not None:
            self._background.wait()

    def close(self) -> None:
        """Wait for the save in flight, then release the staging buffers and threads."""
        if self._background is not None:
            self._background.close()

    def _remove(self, uri: str) -> None:
        removed = catalog.remove_checkpoint(uri, config=self.config)
        log.debug("removed %s (%d objects)", uri, removed.objects)


def s3_path(path: str | os.PathLike[str]) -> str:
    """``path`` as an ``s3://`` URI; a local path is refused with one clear error."""
    if not is_s3(path):
        raise ConfigError(
            f"the s3ckpt Lightning strategies save to s3:// paths, got {os.fspath(path)!r}: "
            "use ModelCheckpoint(dirpath='s3://bucket/run'), or Lightning's own strategy "
            "for local folders"
        )
    return lightning_uri(path)


def pack_metadata(metadata: dict[str, Any]) -> bytes:
    """What Lightning writes to ``meta.pt``, as bytes."""
    buffer = io.BytesIO()
    torch.save(metadata, buffer)
    return buffer.getvalue()


def unpack_metadata(data: bytes, weights_only: bool | None) -> dict[str, Any]:
    """:func:`pack_metadata`'s dict, read as Lightning reads ``meta.pt``."""
    return torch.load(io.BytesIO(data), weights_only=weights_only)
