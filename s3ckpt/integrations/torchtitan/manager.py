"""``S3CheckpointManager``: torchtitan's ``CheckpointManager`` over s3ckpt, overriding its
storage hooks (``dcp_save``, ``dcp_load``), step discovery (``_find_load_step``) and
retention (``_purge_stale_checkpoints``) for an ``s3://`` folder; the overview is
:mod:`s3ckpt.integrations.torchtitan`'s."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager
from torchtitan.components.checkpointer.base import purge_thread

from s3ckpt import catalog
from s3ckpt.background.process import CheckpointProcess
from s3ckpt.catalog.steps import leaf, step_of
from s3ckpt.config import S3Config, make_config
from s3ckpt.dcp.reader import S3StorageReader
from s3ckpt.dcp.writer import S3StorageWriter
from s3ckpt.errors import CheckpointError, CheckpointNotFoundError, ConfigError
from s3ckpt.integrations.fsspec_s3 import configure_fsspec
from s3ckpt.integrations.torchtitan.async_modes import (
    StagedByTheCheckpointProcess,
    as_torchtitan_expects,
)
from s3ckpt.integrations.torchtitan.hf_export import HF_SOURCE, export_to_hf, on_rank_zero
from s3ckpt.integrations.torchtitan.options import SECRETS, memory_tier_of
from s3ckpt.tier.process import TieredCheckpointProcess
from s3ckpt.tier.restore import Restored

log = logging.getLogger("s3ckpt.integrations.torchtitan")


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

        memory_tier: dict[str, Any] = field(default_factory=dict)
        """Keyword arguments of an ``s3ckpt.MemoryTier`` (``keep``, ``s3_every``, ``root``,
        ``replicas``, ``max_bytes``...): every interval save is held in shared memory on
        the node, and only the steps ``s3_every`` divides also go to S3. Empty (default):
        no memory tier. Needs an async mode."""

        def __post_init__(self) -> None:
            # torchtitan refuses last_save_in_hf for a remote folder: it writes HF files
            # with the file system. This manager writes them itself, so that one check of
            # torchtitan's is skipped and the rest of its checks run as they are.
            in_hf, self.last_save_in_hf = self.last_save_in_hf, False
            try:
                CheckpointManager.Config.__post_init__(self)
            finally:
                self.last_save_in_hf = in_hf
            if in_hf and not self.last_save_model_only:
                raise ConfigError("last_save_in_hf requires last_save_model_only=True")
            secrets = SECRETS & set(self.s3_options)
            if secrets:
                raise ConfigError(
                    f"s3_options must not hold credentials ({', '.join(sorted(secrets))}): "
                    "the configuration is logged; use the AWS environment or a profile"
                )
            if self.enable and not self.folder.startswith("s3://"):
                raise ConfigError(f"S3CheckpointManager needs an s3:// folder, got {self.folder!r}")
            if self.memory_tier:
                if self.async_mode == AsyncMode.DISABLED.value:
                    raise ConfigError(
                        "memory_tier needs async_mode 'async' or 'async_with_pinned_mem' "
                        "(the checkpoint process holds the copies), not 'disabled'"
                    )
                memory_tier_of(self.memory_tier)

    def __init__(self, config: Config, **kwargs: Any) -> None:
        self.s3_config: S3Config = make_config(
            None, endpoint_url=config.endpoint_url, **config.s3_options
        )
        self.writer_options = dict(config.writer_options)
        self.reader_options = dict(config.reader_options)
        self.memory_tier = memory_tier_of(config.memory_tier) if config.memory_tier else None
        self.tiered: TieredCheckpointProcess | None = None
        self.last_restore: Restored | None = None
        self.named_steps: dict[int, str] = {}  # step -> URI, from the last discovery
        self._noted: set[str] = set()  # names discovery logged as not steps
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
        self.checkpoint_process: CheckpointProcess | None = None
        if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # torchtitan builds a DefaultStager at the first save unless one is there; the
            # checkpoint process stages instead (pinned where CUDA is), so none is needed
            # (DCP's refuses to exist without an accelerator).
            self.stager = StagedByTheCheckpointProcess()
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
        if not checkpoint_id.startswith("s3://"):
            return super().dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        if to_hf:  # the last step, always saved synchronously by torchtitan
            self.save_in_hf(state_dict, checkpoint_id)
            return None
        if self.memory_tier is not None and async_mode != AsyncMode.DISABLED:
            return self._save_tiered(state_dict, checkpoint_id, async_mode)
        writer = self._writer(checkpoint_id)
        if async_mode in (AsyncMode.ASYNC, AsyncMode.ASYNC_WITH_PINNED_MEM):
            if self.checkpoint_process is None:  # every rank saves its first step together
                self.checkpoint_process = CheckpointProcess(self.pg)
            upload = self.checkpoint_process.async_save(state_dict, storage_writer=writer)
            return as_torchtitan_expects(upload, async_mode)
        dcp.save(state_dict, storage_writer=writer)
        return None

    def _writer(self, checkpoint_id: str) -> S3StorageWriter:
        self.saved_last = checkpoint_id
        return S3StorageWriter(
            checkpoint_id, config=self.s3_config, overwrite=True, **self.writer_options
        )

    def _save_tiered(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any) -> Any:
        """Hold the step in memory; upload it too when the tier's ``s3_every`` says so."""
        assert self.memory_tier is not None
        step = step_of(leaf(checkpoint_id))
        if step is None:
            raise CheckpointError(f"{checkpoint_id} does not end in step-N: no step to hold")
        writer = self._writer(checkpoint_id) if self.memory_tier.to_s3(step) else None
        save = self._tiered_process().async_save(state_dict, step, storage_writer=writer)
        return as_torchtitan_expects(save.done, async_mode)

    def _tiered_process(self) -> TieredCheckpointProcess:
        """The memory tier's checkpoint process, made at the first save or load (every
        rank reaches both together)."""
        assert self.memory_tier is not None
        if self.tiered is None:
            self.tiered = TieredCheckpointProcess(self.folder, self.memory_tier, self.pg)
        return self.tiered

    def _load(self, step: int = -1) -> bool:
        """With a memory tier, the latest step comes from memory when the whole job holds
        one intact at least as new as the newest resumable S3 step (module docstring)."""
        if self.memory_tier is None or step != -1:
            return super()._load(step)
        s3_step = self._find_load_step()
        states = self._states_to_load(model_only=False)
        restored = self._tiered_process().restore_latest(
            states, s3_latest=s3_step if s3_step >= 0 else None
        )
        if restored is None:  # the step found above: torchtitan need not list S3 again
            return super()._load(s3_step if s3_step >= 0 else step)
        if MODEL in self.states:  # flattened into the top level, as dcp_load applies it
            self.states[MODEL].load_state_dict(states)
        self.last_restore = restored
        log.info(
            "loaded step-%d from the memory tier in %.2f s", restored.step,
            restored.select_s + restored.load_s,
        )  # fmt: skip
        return True

    def _close(self) -> None:
        super()._close()
        process, self.checkpoint_process = getattr(self, "checkpoint_process", None), None
        tiered, self.tiered = getattr(self, "tiered", None), None
        try:
            if process is not None:
                process.close()
        finally:
            if tiered is not None:
                tiered.close()

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

    def save_in_hf(self, state_dict: dict[str, Any], checkpoint_id: str) -> None:
        """The model as Hugging Face safetensors at ``checkpoint_id`` (module docstring).

        The model goes through an s3ckpt checkpoint first so that every rank saves its
        own shards (FSDP, TP, PP alike) and the export reads whole tensors back through
        DCP, a window at a time; rank 0 alone writes the files.
        """
        if self.sd_adapter is None:  # torchtitan's __init__ refuses this already
            raise ConfigError("last_save_in_hf needs the model's state-dict adapter (sd_adapter)")
        hf_state = self.sd_adapter.to_hf(state_dict)
        # Read after to_hf, which may drop a name from it (a tied lm_head).
        mapping = self.sd_adapter.fqn_to_index_mapping
        source = checkpoint_id + HF_SOURCE
        writer = S3StorageWriter(
            source, config=self.s3_config, overwrite=True, **self.writer_options
        )
        dcp.save(hf_state, storage_writer=writer)
        on_rank_zero(
            lambda: export_to_hf(source, checkpoint_id, mapping, self.sd_adapter, self.s3_config)
        )

    # -- steps and retention ------------------------------------------------------------

    def committed_steps(self, folder: str = "") -> dict[int, str]:
        """The committed steps directly under ``folder``: step -> URI. Any ``step-<digits>``
        name is a step (:func:`s3ckpt.step_of`: ``step-0000000300``, written by
        ``s3ckpt.CheckpointManager``, is step 300); of two names of one step, the padded
        one. What is not taken for a step is logged once (``step-300.hf-source``...)."""
        where = folder or self.folder
        found = catalog.run_steps(where, config=self.s3_config)
        for note in (n for n in found.notes if n.name not in self._noted):
            self._noted.add(note.name)
            log.log(logging.WARNING if note.warn else logging.INFO, "%s: %s", where, note.why)
        steps = {step: f"{where.rstrip('/')}/{name}" for step, name in found.names.items()}
        if where == self.folder:
            self.named_steps = steps
        return steps

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        """``<folder>/step-N``, torchtitan's name, unless discovery found the step committed
        under another name (``step-0000000300``): loads and saves of the step then use it."""
        known = self.named_steps.get(step)
        if known is not None and (folder or self.folder) == self.folder:
            return known
        return super()._create_checkpoint_id(step, folder)

    def _find_load_step(self, folder: str = "") -> int:
        if not (folder or self.folder).startswith("s3://"):
            return super()._find_load_step(folder)
        steps = self.committed_steps(folder)
        for step in sorted(steps, reverse=True):
            # torchtitan loads step 0, its seed checkpoint, as the model alone.
            if step == 0 or self.holds_training_state(steps[step]):
                return step
            log.info("%s holds the model alone: not a point to resume from", steps[step])
        return -1

    def holds_training_state(self, uri: str) -> bool:
        """Whether the checkpoint at ``uri`` holds more than the model (optimizer, train
        state...): a last save with ``last_save_model_only`` holds the model alone, maybe
        converted to ``export_dtype``, and resuming from it would fail. One read of its
        manifest and DCP metadata, on each rank (no collective: ranks may call this alone)."""
        others = set(self.states) - {MODEL}
        if not others:
            return True
        reader = S3StorageReader(uri, config=self.s3_config, **self.reader_options)
        stored = reader.read_metadata().state_dict_metadata
        return any(fqn.split(".", 1)[0] in others for fqn in stored)

    def _should_purge(self) -> bool:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return self.keep_latest_k > 0 and rank == 0

    def _purge_stale_checkpoints(self) -> None:
        if not self._should_purge():
            return
        steps = self.committed_steps()
        # As in torchtitan, the save just started counts among the k kept, committed or not.
        kept = set(steps)
        latest = step_of(leaf(self.saved_last)) if self.saved_last else None
        if latest is not None:
            kept.add(latest)
        for step in sorted(kept)[: -self.keep_latest_k]:
            if step in steps:
                self.purge_queue.put(steps[step])

    def _remove(self, uri: str) -> None:
        try:
            catalog.remove_checkpoint(uri, config=self.s3_config)
        except CheckpointNotFoundError:
            log.debug("%s was already removed", uri)
