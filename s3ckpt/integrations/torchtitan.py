"""torchtitan checkpoints on S3 through s3ckpt: ``S3CheckpointManager``.

torchtitan's ``CheckpointManager`` (``torchtitan.components.checkpointer``) saves
``step-N`` checkpoints with DCP and takes custom storage by subclassing: ``dcp_save`` and
``dcp_load`` pick the storage writer and reader, ``_find_load_step`` discovers the steps
(it looks for ``step-N/.metadata``, a FileSystemWriter file that an s3ckpt checkpoint does
not have: its commit is ``step-N/manifest.json``), ``_purge_stale_checkpoints`` applies
``keep_latest_k``. This subclass overrides exactly those, for an ``s3://`` folder:

* saves go through :class:`~s3ckpt.S3StorageWriter` in each of torchtitan's async modes
  (``disabled``: ``dcp.save``; ``async`` and ``async_with_pinned_mem``: the rank's
  :class:`~s3ckpt.CheckpointProcess`, which uploads from host memory shared with the
  trainer, pinned with CUDA, so the training loop's interpreter does nothing for the
  upload; it meets the other ranks on torchtitan's gloo group); saving a step again
  replaces it atomically, as the file system version overwrites;
* loads go through :class:`~s3ckpt.S3StorageReader`;
* the latest step is the highest *committed* ``step-N`` (a save killed half-way is never
  picked); any ``step-<digits>`` name is a step (:func:`s3ckpt.step_of`), so steps that
  ``s3ckpt.CheckpointManager`` wrote (``step-0000000300``) are found and loaded too, and a
  step named both ways is read from the padded name (logged);
* retention, after each save but the last (as torchtitan does), keeps the ``keep_latest_k``
  newest steps, the one just saved (committed or still uploading) included, and deletes
  the older committed ones through the catalog (manifest first) on torchtitan's purge
  thread.

* the last step (``last_save_model_only``, torchtitan's default) holds the model alone, in
  ``export_dtype``: it is committed as ``step-N`` like the others but is no point to resume
  from, so discovery skips it (its stored names hold no state but the model's) and picks
  the newest step that holds the whole training state;
* with ``last_save_in_hf`` (which torchtitan refuses for a remote folder), the last step is
  written as Hugging Face safetensors under ``step-N``: the model, named and laid out by
  torchtitan's state-dict adapter (``sd_adapter.to_hf``; the shards of its
  ``fqn_to_index_mapping``, read from ``model.safetensors.index.json`` in
  ``hf_assets_path``, else one ``model.safetensors``), is saved by every rank as an s3ckpt
  checkpoint at ``step-N.hf-source`` and exported from there by rank 0 with
  :func:`s3ckpt.interop.export.export_checkpoint` (as ``s3ckpt export`` does: whole
  tensors whatever the parallelism, every byte checked), with ``config.json`` and
  ``generation_config.json`` from ``hf_assets_path`` when it has them. The index,
  ``model.safetensors.index.json``, is written last; an export that fails removes what it
  wrote, keeps ``step-N.hf-source`` and fails the save on every rank; one that succeeds
  removes ``step-N.hf-source``. ``step-N`` then holds safetensors, not an s3ckpt
  checkpoint: neither is a resume point.

* with ``memory_tier`` (the keywords of :class:`s3ckpt.MemoryTier`; an async mode), every
  interval save is held in shared memory on its node (and replicated to a peer node), and
  only the steps ``s3_every`` divides are also written to S3, from the same memory
  (:class:`~s3ckpt.TieredCheckpointProcess`); a restart (``load()`` of the latest step)
  restores the newest step the whole job holds intact in memory when it is at least the
  newest resumable S3 step, agreed across ranks, and from S3 otherwise; ``last_restore``
  says which. Retention (``keep_latest_k``) counts the S3 steps alone; the tier keeps its
  own ``keep``.

Loads of HF safetensors and local paths (``initial_load_path``) stay torchtitan's.
torchtitan checks that the folder exists through fsspec, i.e. s3fs: the manager points
s3fs at the same endpoint (``configure_fsspec``), so s3fs must be installed. Select it in
the trainer's configuration::

    from s3ckpt.integrations.torchtitan import S3CheckpointManager

    config.checkpoint = S3CheckpointManager.Config(
        enable=True, folder="s3://ckpt/llama3-8b", interval=500, keep_latest_k=3,
        async_mode="async", endpoint_url="https://flashblade.example.com",
        writer_options={"compression": "zstd"},
        memory_tier={"keep": 2, "s3_every": 5000},  # optional: hold every save in memory
        last_save_model_only=True, last_save_in_hf=True, export_dtype="bfloat16")

Credentials come from the AWS environment or a profile (``s3_options={"profile": ...}``),
never from the configuration, which torchtitan logs.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager
from torchtitan.components.checkpointer.base import purge_thread

from s3ckpt import catalog
from s3ckpt.background.process import CheckpointProcess
from s3ckpt.catalog.steps import leaf, step_of
from s3ckpt.config import S3Config, make_config
from s3ckpt.dcp.reader import S3StorageReader
from s3ckpt.dcp.writer import S3StorageWriter
from s3ckpt.errors import CheckpointError, CheckpointNotFoundError, ConfigError, S3CkptError
from s3ckpt.integrations.fsspec_s3 import configure_fsspec
from s3ckpt.interop.export import export_checkpoint
from s3ckpt.tier.options import MemoryTier
from s3ckpt.tier.process import TieredCheckpointProcess
from s3ckpt.tier.restore import Restored

log = logging.getLogger(__name__)

_SECRETS = frozenset({"access_key_id", "secret_access_key", "session_token"})
HF_SOURCE = ".hf-source"  # step-N + this: the model an HF export at step-N is written from
HF_CONFIG_FILES = ("config.json", "generation_config.json")  # copied from hf_assets_path


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
            secrets = _SECRETS & set(self.s3_options)
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
            self.stager = _StagedByTheCheckpointProcess()
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
            return _as_torchtitan_expects(upload, async_mode)
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
        return _as_torchtitan_expects(save.done, async_mode)

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
        _on_rank_zero(lambda: self._export(source, checkpoint_id, mapping))

    def _export(self, source: str, out: str, mapping: Mapping[Any, int] | None) -> None:
        try:
            export_checkpoint(
                source,
                out,
                format="safetensors",
                overwrite=True,  # as torchtitan's file system save writes over a folder
                shard_of={str(k): int(v) for k, v in mapping.items()} if mapping else None,
                files=self._hf_config_files(),
                config=self.s3_config,
            )
        except Exception as exc:
            raise CheckpointError(
                f"the Hugging Face export of {source} into {out} failed (what it wrote "
                f"there is removed); the model stays saved at {source}: {exc}"
            ) from exc
        log.info("saved the model as Hugging Face safetensors at %s", out)
        try:
            catalog.remove_checkpoint(source, config=self.s3_config)
        except S3CkptError as exc:  # the export is whole: the run need not fail for this
            log.warning("could not remove %s (s3ckpt rm removes it): %s", source, exc)

    def _hf_config_files(self) -> dict[str, bytes]:
        """The model's configuration from torchtitan's Hugging Face assets folder, if local."""
        folder = getattr(self.sd_adapter, "hf_assets_path", None)
        if not folder or "://" in str(folder):
            return {}
        paths = (Path(folder) / name for name in HF_CONFIG_FILES)
        return {path.name: path.read_bytes() for path in paths if path.is_file()}

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


def memory_tier_of(options: Mapping[str, Any]) -> MemoryTier:
    """The ``MemoryTier`` a configuration's ``memory_tier`` keywords describe."""
    try:
        return MemoryTier(**options)
    except TypeError as exc:
        raise ConfigError(f"memory_tier: {exc}") from None


def _as_torchtitan_expects(upload: Future[Any], async_mode: Any) -> Any:
    """``async``: the upload's future; ``async_with_pinned_mem``: a response whose
    staging is already complete (the copy is done when the save returns)."""
    if async_mode == AsyncMode.ASYNC:
        return upload
    staged: Future[None] = Future()
    staged.set_result(None)
    return AsyncSaveResponse(staging_completion=staged, upload_completion=upload)


class _StagedByTheCheckpointProcess:
    """Stands in torchtitan's ``stager`` slot: the checkpoint process does the staging."""

    def close(self) -> None:
        """Nothing to release: the checkpoint process owns the staging memory."""


def _on_rank_zero(action: Callable[[], None]) -> None:
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
