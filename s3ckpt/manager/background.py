"""Starting a save's upload in the background: the stage of the data flow between the
training loop's state and a running ``dcp.save``.

The loop blocks only while the state is copied to host memory, into the buffers of one
:class:`~s3ckpt.dcp.staging.HostStager` kept from save to save. The upload of that copy
then runs on the manager's worker thread (thread mode: ``dcp.save`` on a gloo group of
its own, as DCP's ``async_save`` would run it on a thread of its own, without its
per-entry work and thread start in the stall) or in DCP's background process (process
mode: ``async_save`` of the copy).

A rank whose copy fails raises its error at once, but first starts its save with a
:class:`_CopyFailed` writer: that save fails in planning, DCP gathers the failure and
raises it on every rank, so no rank waits for this one in the save's collectives.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from s3ckpt.dcp.compat import stop_async_save_process
from s3ckpt.dcp.staging import AlreadyStaged, HostStager, plain_state_dict
from s3ckpt.dcp.writer import S3StorageWriter
from s3ckpt.errors import CheckpointError
from s3ckpt.manager.policy import AsyncMode, checkpoint_name
from s3ckpt.manager.ranks import Ranks

log = logging.getLogger("s3ckpt.manager")


class BackgroundSaves:
    """The staging buffers, the worker thread and the save group of one manager."""

    def __init__(self, ranks: Ranks, async_mode: AsyncMode) -> None:
        self._ranks = ranks
        self._process = async_mode == "process"
        self._save_group = ranks.save_group(async_mode)
        self._stager = HostStager(share_memory=self._process)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s3ckpt-save")

    def start(
        self, step: int, state_dict: dict[str, Any], writer: S3StorageWriter
    ) -> tuple[Future[Any], Exception | None]:
        """Copy ``state_dict`` to host memory, then start its upload; the upload's future,
        and this rank's copy failure if it had one (the caller raises it)."""
        try:
            staged, failure = self._stager.stage(plain_state_dict(state_dict)), None
        except Exception as exc:
            if self._ranks.world == 1:
                raise
            staged, failure = {}, exc
            writer = _CopyFailed(writer, _failure_reason(step, self._ranks.rank, exc))
        if self._process:
            future = dcp.async_save(
                staged,
                storage_writer=writer,
                process_group=self._ranks.group,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=AlreadyStaged(),
                no_dist=not self._ranks.distributed,
            )
        else:
            future = self._worker.submit(
                dcp.save, staged, storage_writer=writer,
                process_group=self._save_group, no_dist=self._save_group is None,
            )  # fmt: skip
        return future, failure

    def close(self) -> None:
        """After the last save: stop the worker (once its bookkeeping ran), free the
        buffers, stop DCP's process, drop the save group."""
        self._worker.shutdown(wait=True)
        self._stager.close()
        if self._process:
            stop_async_save_process()
        if self._save_group is not None:
            try:
                dist.destroy_process_group(self._save_group)
            except Exception:  # the default group may be gone already
                log.debug("could not destroy the checkpoint process group", exc_info=True)


class _CopyFailed(S3StorageWriter):
    """The writer of a rank whose copy to host memory failed: its part of the save's
    planning raises ``reason``, which DCP gathers and raises on every rank. It touches
    nothing in the store."""

    def __init__(self, writer: S3StorageWriter, reason: str) -> None:
        super().__init__(str(writer.location), config=writer.config)
        self.reason = reason

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        raise CheckpointError(self.reason)


def _failure_reason(step: int, rank: int, exc: Exception) -> str:
    return (
        f"{checkpoint_name(step)} not saved: rank {rank} could not copy its state to host "
        f"memory ({type(exc).__name__}: {exc})"
    )
