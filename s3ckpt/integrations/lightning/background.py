"""Lightning's sharded saves in the background: staged to host memory, uploaded by the
rank's checkpoint process, at most one in flight.

A save blocks the training loop while its state is copied into host memory shared with
the rank's checkpoint process (:class:`~s3ckpt.background.saver.BackgroundSaver`, kept
from save to save), not while it uploads. The next save, and the strategy's teardown,
first wait for the one in flight, which is also what lets the memory be reused; a failed
save raises there.

Removals Lightning asks for while a save is in flight (top-k rotation removes the
previous best as soon as the new one is saved) are carried out once that save has
committed, so a crash or a failed upload never leaves fewer checkpoints than before; when
the save fails they are dropped and the older checkpoints stay.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from s3ckpt.background.saver import BackgroundSaver, SaverMode, state_bytes
from s3ckpt.dcp.writer import S3StorageWriter
from s3ckpt.errors import CheckpointNotFoundError

log = logging.getLogger(__name__)


@dataclass
class _Save:
    """One save in flight: its location, its upload, the removals waiting for it."""

    uri: str
    future: Future[Any] | None = None
    finished: bool = False
    removals: list[str] = field(default_factory=list)
    settled: threading.Event = field(default_factory=threading.Event)


class BackgroundSaves:
    """The background saver of one strategy and the removals waiting for its save;
    created at the first save (every rank saves together), released by :meth:`close`."""

    def __init__(self, remove: Callable[[str], None], mode: SaverMode = "process") -> None:
        self._remove = remove
        self._mode: SaverMode = mode
        self._lock = threading.Lock()
        self._saver: BackgroundSaver | None = None
        self._pending: _Save | None = None

    def start(self, uri: str, state: dict[str, Any], writer: S3StorageWriter) -> None:
        """Wait for the save in flight, copy ``state`` to host memory, start its upload."""
        self.wait()
        if self._saver is None:
            # only the state's bytes come back (logged), not DCP's metadata to unpickle
            self._saver = BackgroundSaver(self._mode, reply=state_bytes)
        save = _Save(uri)
        save.future, failure = self._saver.start(state, writer, uri)
        save.future.add_done_callback(lambda future: self._settle(save, future))
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
        """Wait for the save in flight to commit (and its removals); raises its failure."""
        save = self._pending
        if save is None or save.future is None:
            return
        try:
            save.future.result()
            save.settled.wait()
        finally:
            self._pending = None

    def close(self) -> None:
        """Wait for the save in flight (raising its failure), then release everything."""
        try:
            self.wait()
        finally:
            saver, self._saver = self._saver, None
            if saver is not None:
                saver.close()

    def _settle(self, save: _Save, future: Future[Any]) -> None:
        """After the upload: the removals it held back, or (failed) none of them."""
        try:
            kept = self._finish(save)
            if future.exception() is not None:
                if kept:
                    log.warning("%s was not saved; keeping %s", save.uri, ", ".join(kept))
                return
            log.debug("%s saved: %d bytes of tensors", save.uri, future.result())
            for uri in kept:
                try:
                    self._remove(uri)
                except CheckpointNotFoundError:
                    log.debug("%s was removed already", uri)
                except Exception:  # the save committed; a failed removal leaves one extra
                    log.warning(
                        "could not remove %s after %s committed", uri, save.uri, exc_info=True
                    )
        finally:
            save.settled.set()

    def _finish(self, save: _Save) -> list[str]:
        """Mark ``save`` finished; the removals that waited for it."""
        with self._lock:
            save.finished = True
            return save.removals
