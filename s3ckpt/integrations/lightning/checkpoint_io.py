"""PyTorch Lightning checkpoints on S3 through s3ckpt: ``S3CheckpointIO``.

Lightning writes every checkpoint through its ``CheckpointIO`` plugin, handing it one
nested dict (weights, optimizer states, loop progress, callback states, hyper-parameters)
and a path built from ``ModelCheckpoint(dirpath=...)``. With ``dirpath="s3://bucket/run"``
and this plugin each path, ``s3://bucket/run/epoch=0-step=100.ckpt``, becomes an s3ckpt
checkpoint (a prefix holding data objects and a manifest committed last), saved by DCP
through :class:`~s3ckpt.S3StorageWriter` and loaded back whole, without a template, by
:mod:`s3ckpt.integrations.nested`::

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from s3ckpt.integrations.lightning import S3CheckpointIO, last_checkpoint

    io = S3CheckpointIO(endpoint_url="https://flashblade.example.com")
    trainer = Trainer(plugins=[AsyncCheckpointIO(io)],        # or plugins=[io]: in the loop
                      callbacks=[ModelCheckpoint(dirpath="s3://ckpt/run1", save_last=True)])
    trainer.fit(model, ckpt_path=last_checkpoint("s3://ckpt/run1", config=io.config))

What Lightning does around the plugin, and how it is covered:

* ``ModelCheckpoint`` checks ``dirpath`` and checkpoint names through fsspec, i.e. s3fs
  for ``s3://`` (``pip install './s3ckpt[lightning]'`` installs it). The plugin points s3fs at
  the same endpoint when it is created (:func:`~s3ckpt.integrations.fsspec_s3.configure_fsspec`;
  ``configure_fsspec=False`` leaves fsspec alone).
* Saving over an existing path (``last.ckpt`` is rewritten at every save) replaces the
  checkpoint atomically; readers see the old one or the new one.
* ``remove_checkpoint`` (top-k and ``last.ckpt`` rotation) deletes through the catalog:
  manifest first, then exactly the objects it lists. Under ``AsyncCheckpointIO`` Lightning
  asks to remove a checkpoint whose save may still be queued or running; the removal is
  then carried out as soon as that save commits, so nothing is left behind.
* Other paths (Lightning's ``ddp_spawn`` hands its final weights back to the main process
  through a local temporary file; ``trainer.save_checkpoint("model.ckpt")``) go to
  Lightning's ``TorchCheckpointIO``, as without the plugin.
* ``fit(ckpt_path="last")`` does not find checkpoints in ``s3://`` directories (Lightning
  drops the scheme from what s3fs lists, warns and starts from scratch);
  :func:`last_checkpoint` finds the newest committed checkpoint under a prefix instead.

Lightning saves from global rank 0 only (replicated state: single device, DDP); the
plugin saves and loads on the calling process alone. Fabric saves through it too: ``Fabric(plugins=[S3CheckpointIO()])``, then
``fabric.save("s3://...", state)`` and ``fabric.load("s3://...", state)``. Strategies that
shard the state themselves bypass any ``CheckpointIO``; their S3 variants are in
:mod:`s3ckpt.integrations.lightning.strategies` and :mod:`~s3ckpt.integrations.lightning.fabric`.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO

from s3ckpt import catalog
from s3ckpt.config import S3URI, S3Config, make_config
from s3ckpt.dcp.reader import S3StorageReader
from s3ckpt.dcp.writer import S3StorageWriter
from s3ckpt.errors import CheckpointNotFoundError
from s3ckpt.integrations.fsspec_s3 import configure_fsspec as point_fsspec_at
from s3ckpt.integrations.nested import load_nested, save_nested

log = logging.getLogger(__name__)


class S3CheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` over s3ckpt; paths are ``s3://bucket/prefix`` URIs.

    Args:
        endpoint_url: the S3 endpoint; ``config`` and keyword ``options`` as for
            :class:`~s3ckpt.S3StorageWriter` (:class:`~s3ckpt.config.S3Config` fields).
        writer_options: keyword arguments for every :class:`~s3ckpt.S3StorageWriter`
            (``compression="zstd"``, ``spread_prefixes=256``...); a save's
            ``storage_options`` (``trainer.save_checkpoint(..., storage_options=...)``)
            override them for that save.
        reader_options: keyword arguments for every :class:`~s3ckpt.S3StorageReader`.
        configure_fsspec: point fsspec's ``s3://`` filesystem at the same store, for
            ``ModelCheckpoint``'s directory checks (process-wide).
    """

    def __init__(
        self,
        *,
        endpoint_url: str | None = None,
        config: S3Config | None = None,
        writer_options: dict[str, Any] | None = None,
        reader_options: dict[str, Any] | None = None,
        configure_fsspec: bool = True,
        **options: Any,
    ) -> None:
        self.config = make_config(config, endpoint_url=endpoint_url, **options)
        self.writer_options = dict(writer_options or {})
        self.reader_options = dict(reader_options or {})
        self.configure_fsspec = configure_fsspec
        if configure_fsspec:
            point_fsspec_at(self.config)
        self._local = TorchCheckpointIO()
        self._lock = threading.Lock()
        self._saving: set[str] = set()
        self._deferred_removals: set[str] = set()

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        """Save ``checkpoint`` at ``path``, replacing a committed one atomically."""
        if not is_s3(path):
            self._local.save_checkpoint(checkpoint, path, storage_options)
            return
        uri = lightning_uri(path)
        options = {**self.writer_options, **(storage_options or {})}
        writer = S3StorageWriter(uri, config=self.config, overwrite=True, **options)
        with self._lock:
            self._saving.add(uri)
        try:
            save_nested(checkpoint, writer)
        finally:
            with self._lock:
                self._saving.discard(uri)
                removal_requested = uri in self._deferred_removals
                self._deferred_removals.discard(uri)
        if removal_requested:
            log.info("removing %s: its removal was asked for while it was being saved", uri)
            self._remove(uri)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: str | torch.device | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """The checkpoint dict saved at ``path``; tensors on the CPU unless ``map_location``.

        ``weights_only`` as in ``torch.load`` (``None``: torch's default, weights-only;
        ``False`` unpickles anything, for buckets you trust).
        """
        if not is_s3(path):
            return self._local.load_checkpoint(path, map_location, weights_only)
        reader = S3StorageReader(lightning_uri(path), config=self.config, **self.reader_options)
        return load_nested(reader, weights_only=weights_only, map_location=map_location)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the checkpoint at ``path`` (manifest first), or once its save commits."""
        if not is_s3(path):
            self._local.remove_checkpoint(path)
            return
        uri = lightning_uri(path)
        with self._lock:
            if uri in self._saving:
                self._deferred_removals.add(uri)
                return
        try:
            self._remove(uri)
        except CheckpointNotFoundError:
            # Not committed: under AsyncCheckpointIO its save is still queued, so it is
            # removed when that save commits. (Lightning removes only paths it saved, and
            # never saves a path again after removing it within one process.)
            with self._lock:
                self._deferred_removals.add(uri)
            log.debug("%s is not committed yet; it will be removed once it is", uri)

    def __getstate__(self) -> dict[str, Any]:
        """Configuration only: ``ddp_spawn`` pickles the plugins into each process (which
        configures its own fsspec on unpickling)."""
        state = self.__dict__.copy()
        for name in ("_lock", "_saving", "_deferred_removals"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.configure_fsspec:
            point_fsspec_at(self.config)
        self._lock = threading.Lock()
        self._saving = set()
        self._deferred_removals = set()

    def teardown(self) -> None:
        with self._lock:
            self._deferred_removals.clear()

    def _remove(self, uri: str) -> None:
        removed = catalog.remove_checkpoint(uri, config=self.config)
        log.debug("removed %s (%d objects)", uri, removed.objects)


def is_s3(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an ``s3://`` location (also as ``s3:/``, see :func:`lightning_uri`)."""
    return os.fspath(path).startswith("s3:/")


def lightning_uri(path: str | os.PathLike[str]) -> str:
    """``path`` as an ``s3://`` URI; repairs ``s3:/bucket/...``, what ``os.path.normpath``
    and ``pathlib`` make of an ``s3://`` path inside Lightning."""
    text = os.fspath(path)
    if text.startswith("s3:/") and not text.startswith("s3://"):
        text = "s3://" + text[len("s3:/") :]
    return str(S3URI.parse(text))


def last_checkpoint(dirpath: str, *, config: S3Config | None = None, **options: Any) -> str | None:
    """The most recently committed checkpoint under ``dirpath``, or ``None``: the
    ``ckpt_path`` to resume from (``fit(ckpt_path="last")`` cannot see ``s3://``)."""
    infos = catalog.list_checkpoints(dirpath, config=make_config(config, **options))
    committed = [info for info in infos if info.committed]
    return max(committed, key=lambda info: info.time).uri if committed else None
