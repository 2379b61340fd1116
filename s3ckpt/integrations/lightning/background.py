"""Lightning's sharded saves in the background: staged to host memory, uploaded on a
worker thread, at most one in flight.

A save blocks the training loop while its state is copied into the host buffers of one
:class:`~s3ckpt.dcp.staging.HostStager` (pinned with CUDA, kept from save to save), not
while it uploads: ``dcp.save`` of the copy runs on a worker thread, on a gloo group of
its own (the training loop's collectives keep the default group). The next save, and the
strategy's teardown, first wait for the one in flight, which is also what lets the
stager reuse its buffers; a failed save raises there.

Removals Lightning asks for while a save is in flight (top-k rotation removes the
previous best as soon as the new one is saved) are carried out once that save has
committed, so a crash or a failed upload never leaves fewer checkpoints than before; when
the save fails they are dropped and the older checkpoints stay.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from s3ckpt.dcp.staging import HostStager, plain_state_dict
from s3ckpt.dcp.writer import S3StorageWriter
from s3ckpt.errors import CheckpointError, CheckpointNotFoundError

log = logging.getLogger(__name__)


@dataclass
class _Save:
    """One save in flight: its location, its upload, the removals waiting for it."""

    uri: str
    future: Future[None] | None = None
    finished: bool = False
    removals: list[str] = field(default_factory=list)


class BackgroundSaves:
    """The staging buffers, the worker thread and the save group of one strategy;
    created at the first save (every rank saves together), released by :meth:`close`."""

    def __init__(self, remove: Callable[[str], None]) -> None:
        self._remove = remove
        self._lock = threading.Lock()
        self._stager: HostStager | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._group: dist.ProcessGroup | None = None
        self._pending: _Save | None = None

    def start(self, uri: str, state: dict[str, Any], writer: S3StorageWriter) -> None:
        """Wait for the save in flight, copy ``state`` to host memory, start its upload."""
        self.wait()
        stager, worker = self._open()
        save = _Save(uri)
        try:
            staged, failure = stager.stage(plain_state_dict(state)), None
        except Exception as exc:
            if self._group is None:
                raise
            # The other ranks are starting this save's collectives: fail its planning on
            # every rank instead of leaving them waiting for this one.
            staged, failure = {}, exc
            writer = _CopyFailed(writer, f"rank {dist.get_rank()} could not stage {uri}: {exc}")
        save.future = worker.submit(self._upload, save, staged, writer)
        self._pending = save
        if failure is not None:
            raise failure

    def defer_removal(self, uri: str) -> bool:
        """Remove ``uri`` once the save in flight commits; False when none is in flight."""
        with self._lock:
            save = self._pending
            if save is None or save.finished:
                return False
            save.removals.append(uri)
            return True

    def wait(self) -> None:
        """Wait for the save in flight to commit; raises its failure."""
        save = self._pending
        if save is None or save.future is None:
            return
        try:
            save.future.result()
        finally:
            self._pending = None

    def close(self) -> None:
        """Wait for the save in flight (raising its failure), then release everything."""
        try:
            self.wait()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
            if self._stager is not None:
                self._stager.close()
            if self._group is not None:
                try:
                    dist.destroy_process_group(self._group)
                except Exception:  # the default group may be gone already
                    log.debug("could not destroy the checkpoint process group", exc_info=True)
            self._worker = self._stager = self._group = None

    def _open(self) -> tuple[HostStager, ThreadPoolExecutor]:
        if self._stager is None or self._worker is None:
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                self._group = dist.new_group(backend="gloo")
            self._stager = HostStager()
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s3ckpt-lightning")
        return self._stager, self._worker

    def _upload(self, save: _Save, staged: dict[str, Any], writer: S3StorageWriter) -> None:
        try:
            dcp.save(
                staged,
                storage_writer=writer,
                process_group=self._group,
                no_dist=self._group is None,
            )
        except BaseException:
            kept = self._finish(save)
            if kept:
                log.warning("%s was not saved; keeping %s", save.uri, ", ".join(kept))
            raise
        for uri in self._finish(save):
            try:
                self._remove(uri)
            except CheckpointNotFoundError:
                log.debug("%s was removed already", uri)
            except Exception:  # the save committed; a failed removal leaves one extra
                log.warning("could not remove %s after %s committed", uri, save.uri, exc_info=True)

    def _finish(self, save: _Save) -> list[str]:
        """Mark ``save`` finished; the removals that waited for it."""
        with self._lock:
            save.finished = True
            return save.removals


class _CopyFailed(S3StorageWriter):
    """The writer of a rank whose copy to host memory failed: its part of the save's
    planning raises ``reason``, which DCP gathers and raises on every rank."""

    def __init__(self, writer: S3StorageWriter, reason: str) -> None:
        super().__init__(str(writer.location), config=writer.config)
        self.reason = reason

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        raise CheckpointError(self.reason)
