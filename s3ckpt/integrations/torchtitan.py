"""torchtitan checkpoints on S3 through s3ckpt: ``S3CheckpointManager``.

torchtitan's ``CheckpointManager`` (``torchtitan.components.checkpointer``) saves
``step-N`` checkpoints with DCP and takes custom storage by subclassing: ``dcp_save`` and
``dcp_load`` pick the storage writer and reader, ``_find_load_step`` discovers the steps
(it looks for ``step-N/.metadata``, a FileSystemWriter file that an s3ckpt checkpoint does
not have: its commit is ``step-N/manifest.json``), ``_purge_stale_checkpoints`` applies
``keep_latest_k``. This subclass overrides exactly those, for an ``s3://`` folder:

* saves go through :class:`~s3ckpt.S3StorageWriter` in each of torchtitan's async modes
  (``disabled``: ``dcp.save``; ``async``: ``dcp.async_save`` on torchtitan's gloo group;
  ``async_with_pinned_mem``: process mode with torchtitan's stager); saving a step again
  replaces it atomically, as the file system version overwrites;
* loads go through :class:`~s3ckpt.S3StorageReader`;
* the latest step is the highest *committed* ``step-N`` (a save killed half-way is never
  picked);
* retention, after each save but the last (as torchtitan does), keeps the ``keep_latest_k``
  newest steps, the one just saved (committed or still uploading) included, and deletes
  the older committed ones through the catalog (manifest first) on torchtitan's purge
  thread.

HF safetensors saves and loads, and local paths (``initial_load_path``), stay
torchtitan's. torchtitan checks that the folder exists through fsspec, i.e. s3fs: the
manager points s3fs at the same endpoint (``configure_fsspec``), so s3fs must be
installed. Select it in the trainer's configuration::

    from s3ckpt.integrations.torchtitan import S3CheckpointManager

    config.checkpoint = S3CheckpointManager.Config(
        enable=True, folder="s3://ckpt/llama3-8b", interval=500, keep_latest_k=3,
        async_mode="async", endpoint_url="https://flashblade.example.com",
        writer_options={"compression": "zstd"})

Credentials come from the AWS environment or a profile (``s3_options={"profile": ...}``),
never from the configuration, which torchtitan logs.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager
from torchtitan.components.checkpointer.base import purge_thread

from s3ckpt import catalog
from s3ckpt.config import S3Config, make_config
from s3ckpt.dcp.reader import S3StorageReader
from s3ckpt.dcp.writer import S3StorageWriter
from s3ckpt.errors import CheckpointNotFoundError, ConfigError
from s3ckpt.integrations.fsspec_s3 import configure_fsspec

log = logging.getLogger(__name__)

_STEP = re.compile(r"step-(\d+)")
_SECRETS = frozenset({"access_key_id", "secret_access_key", "session_token"})


class S3CheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with an ``s3://`` folder stored by s3ckpt."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        endpoint_url: str | None = None
        """The S3 endpoint; ``None`` uses ``AWS_ENDPOINT_URL``."""

        s3_options: dict[str, Any] = field(default_factory=dict)
        """Further ``s3ckpt.S3Config`` fields (``profile``, ``region``, ``verify``,
        ``max_concurrency``, ``part_size``...); no credentials."""

        writer_options: dict[str, Any] = field(default_factory=dict)
        """Keyword arguments of every ``S3StorageWriter`` (``compression``...)."""

        reader_options: dict[str, Any] = field(default_factory=dict)
        """Keyword arguments of every ``S3StorageReader``."""

        configure_fsspec: bool = True
        """Point fsspec's s3 filesystem (s3fs) at the same store."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            secrets = _SECRETS & set(self.s3_options)
            if secrets:
                raise ConfigError(
                    f"s3_options must not hold credentials ({', '.join(sorted(secrets))}): "
                    "the configuration is logged; use the AWS environment or a profile"
                )
            if self.enable and not self.folder.startswith("s3://"):
                raise ConfigError(f"S3CheckpointManager needs an s3:// folder, got {self.folder!r}")

    def __init__(self, config: Config, **kwargs: Any) -> None:
        self.s3_config: S3Config = make_config(
            None, endpoint_url=config.endpoint_url, **config.s3_options
        )
        self.writer_options = dict(config.writer_options)
        self.reader_options = dict(config.reader_options)
        if not config.enable:
            super().__init__(config, **kwargs)
            return
        if config.configure_fsspec:
            configure_fsspec(self.s3_config)
        # torchtitan's purge thread deletes with fsspec (data before manifest); start it
        # here instead, deleting through the catalog.
        super().__init__(dataclasses.replace(config, keep_latest_k=0), **kwargs)
        self.keep_latest_k = config.keep_latest_k
        self.saved_last: str | None = None  # the latest save, committed or still in flight
        if self.keep_latest_k > 0:
            self.purge_queue: queue.Queue[str | None] = queue.Queue()
            self.purge_thread = threading.Thread(
                target=purge_thread, args=(self.purge_queue, self._remove), daemon=True
            )
            self.purge_thread.start()

    # -- storage ----------------------------------------------------------------------

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        if to_hf or not checkpoint_id.startswith("s3://"):
            return super().dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        writer = S3StorageWriter(
            checkpoint_id, config=self.s3_config, overwrite=True, **self.writer_options
        )
        self.saved_last = checkpoint_id
        if async_mode == AsyncMode.ASYNC:
            return dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            return dcp.async_save(
                state_dict,
                storage_writer=writer,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )
        dcp.save(state_dict, storage_writer=writer)
        return None

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        if from_hf or not checkpoint_id.startswith("s3://"):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        # dcp.load runs on the default group here: its ranks share one metadata read.
        shared = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
        reader = S3StorageReader(
            checkpoint_id, config=self.s3_config, process_group=shared, **self.reader_options
        )
        dcp.load(state_dict, storage_reader=reader)
        # The model's entries are flattened into the top level; torchtitan applies them
        # the same way after its own loads.
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    # -- steps and retention ------------------------------------------------------------

    def committed_steps(self, folder: str = "") -> dict[int, str]:
        """The committed ``step-N`` checkpoints directly under ``folder``: step -> URI."""
        found = catalog.list_checkpoints(folder or self.folder, config=self.s3_config)
        steps = {}
        for info in found:
            match = _STEP.fullmatch(info.name)
            if info.committed and match:
                steps[int(match.group(1))] = info.uri
        return steps

    def _find_load_step(self, folder: str = "") -> int:
        if not (folder or self.folder).startswith("s3://"):
            return super()._find_load_step(folder)
        return max(self.committed_steps(folder), default=-1)

    def _should_purge(self) -> bool:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return self.keep_latest_k > 0 and rank == 0

    def _purge_stale_checkpoints(self) -> None:
        if not self._should_purge():
            return
        steps = self.committed_steps()
        # As in torchtitan, the save just started counts among the k kept, committed or not.
        kept = set(steps)
        latest = _STEP.fullmatch(self.saved_last.rsplit("/", 1)[-1]) if self.saved_last else None
        if latest:
            kept.add(int(latest.group(1)))
        for step in sorted(kept)[: -self.keep_latest_k]:
            if step in steps:
                self.purge_queue.put(steps[step])

    def _remove(self, uri: str) -> None:
        try:
            catalog.remove_checkpoint(uri, config=self.s3_config)
        except CheckpointNotFoundError:
            log.debug("%s was already removed", uri)
