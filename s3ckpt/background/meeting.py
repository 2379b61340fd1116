"""The checkpoint processes' meeting, and how a meeting that cannot complete ends.

With several ranks the checkpoint processes form a gloo group of their own, met at rank
0's store. A process that dies before the group is formed (killed, out of memory, an
import that fails) would leave its peers waiting in ``init_process_group`` for the whole
collective timeout (half an hour by default), and their trainers' saves with them. Once
formed, the group needs no such care: a dead peer's connections close, and gloo fails the
survivors' collectives at once.

So each trainer watches its own process's meeting from the same store. A trainer whose
process dies before it reported itself ready records that on the store (:meth:`abandon`);
every other trainer's watch sees it within :data:`POLL_S` and stops its own process,
which is still meeting. Every rank's save then fails with
:class:`~s3ckpt.errors.CheckpointProcessError` naming the rank whose process died, and
the next save starts fresh processes on every rank, together, as after any failed save.
The watch is in the trainers, not in the processes, because a process that is inside
``init_process_group`` cannot be asked anything.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

log = logging.getLogger("s3ckpt.background")

POLL_S = 0.5  # how often a trainer looks at the store while its process meets its peers
END_TIMEOUT_S = 10.0  # a look at the store in progress: the store's own timeout bounds it
_ABANDONED = "abandoned"


class MeetingWatch:
    """One generation of checkpoint processes meeting: ``store`` is rank 0's store (the
    one the processes meet at), ``prefix`` that generation's."""

    def __init__(self, store: Any, prefix: str, rank: int) -> None:
        self._store = dist.PrefixStore(f"{prefix}/meeting", store)
        self._rank = rank
        self._met = threading.Event()
        self._ended = threading.Event()  # met, or this rank's process gone: stop watching
        self._thread: threading.Thread | None = None

    def met(self) -> None:
        """This rank's process is in the group: the meeting no longer needs watching."""
        self._met.set()
        self._ended.set()

    def end(self) -> None:
        """This rank's process is gone: stop watching, and wait for the watch to have
        stopped (a thread left inside a call on the store when the interpreter exits
        aborts it)."""
        self._ended.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=END_TIMEOUT_S)

    @property
    def is_met(self) -> bool:
        return self._met.is_set()

    def abandon(self, why: str) -> None:
        """This rank's process died before the group was formed: tell every rank."""
        try:
            self._store.set(_ABANDONED, f"the checkpoint process of rank {self._rank} {why}")
        except Exception:  # rank 0's store is gone: so is the job, and nobody waits
            log.debug("could not record the abandoned meeting", exc_info=True)

    def watch(self, stop_process: Callable[[str], None]) -> None:
        """Until this rank's process has met its peers, call ``stop_process(reason)``
        as soon as another rank abandons the meeting (a daemon thread)."""
        self._thread = threading.Thread(
            target=self._watch, args=(stop_process,), name="s3ckpt-meeting-watch", daemon=True
        )
        self._thread.start()

    def _watch(self, stop_process: Callable[[str], None]) -> None:
        while not self._ended.wait(POLL_S):
            try:
                if not self._store.check([_ABANDONED]):
                    continue
                reason = self._store.get(_ABANDONED).decode()
            except Exception:  # rank 0's store is gone: the job ends without us
                log.debug("stopped watching the checkpoint processes' meeting", exc_info=True)
                return
            if not self._ended.is_set():
                stop_process(reason)
            return
