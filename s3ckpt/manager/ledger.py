"""``SaveLedger``: what a :class:`~s3ckpt.CheckpointManager` records as each save ends.

A background save ends on the thread that resolves its future (the checkpoint process's
reader, or the upload thread), not in the training loop. The ledger does what follows
there: the save's metrics (kept and handed to ``on_saved``), the step counted as
committed, or the failure kept for the loop's next
``save`` or ``wait`` to raise, once. A save held only in the memory tier is recorded
without a commit. The training loop's thread reads the ledger only through
:meth:`SaveLedger.raise_failure` (:meth:`~s3ckpt.manager.saving.Saving.settle`), and
sets ``on_saved`` (the manager's property): the ledger never calls back into the manager.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from s3ckpt.dcp.compat import unwrap
from s3ckpt.errors import CheckpointExistsError, S3CkptError
from s3ckpt.manager.committed import CommittedSteps
from s3ckpt.manager.policy import SaveMetrics, checkpoint_name

log = logging.getLogger("s3ckpt.manager")


@dataclass(eq=False)
class InFlight:
    """A background save, from ``async_save`` returning until its bookkeeping is done."""

    step: int
    future: Future[Any]
    started: float  # perf_counter() when the background part began
    blocked_s: float
    waited_s: float
    done: threading.Event = field(default_factory=threading.Event)
    metrics: SaveMetrics | None = None
    to_s3: bool = True
    nbytes: int = 0  # this rank's staged bytes (what a save held only in memory reports)
    held_at: float | None = None  # perf_counter() when the copy was held in memory
    replicated_at: float | None = None  # ... and when every rank's replicas had landed

    def tier_times(self) -> dict[str, float | None]:
        """``held_s`` and ``replicated_s`` for the metrics: from the background part's start."""
        return {
            "held_s": None if self.held_at is None else self.held_at - self.started,
            "replicated_s": None
            if self.replicated_at is None
            else self.replicated_at - self.started,
        }


class SaveLedger:
    """Metrics, committed steps and the pending failure of one manager's saves.

    Args:
        committed: the steps known committed; each commit adds its step.
        max_metrics: how many recent :class:`SaveMetrics` ``metrics`` keeps.
        on_saved: called with each save's metrics as it ends; the attribute may be replaced at any
            time (the manager's ``on_saved`` property sets it).
    """

    def __init__(
        self,
        committed: CommittedSteps,
        max_metrics: int,
        on_saved: Callable[[SaveMetrics], None] | None,
    ) -> None:
        self._committed = committed
        self.metrics: deque[SaveMetrics] = deque(maxlen=max_metrics)
        self.on_saved = on_saved  # read as each save ends: the manager's ``on_saved`` sets it
        self._lock = threading.Lock()
        self._failure: BaseException | None = None

    def finished(self, inflight: InFlight) -> None:
        try:
            error = inflight.future.exception()
            if error is None and not inflight.to_s3:
                inflight.metrics = self._held_ok(inflight)
            elif error is None:
                upload = time.perf_counter() - inflight.started
                inflight.metrics = self.committed_ok(
                    inflight.step,
                    inflight.future.result(),  # the state's bytes (the saver's reply)
                    inflight.blocked_s,
                    upload,
                    inflight.waited_s,
                    inflight.tier_times(),
                )
            else:
                self._failed(inflight.step, error)
        except BaseException:  # never let bookkeeping leave waiters hanging
            log.exception("bookkeeping after the save of step %d failed", inflight.step)
        finally:
            inflight.done.set()

    def committed_ok(
        self,
        step: int,
        nbytes: int,
        blocked: float,
        upload: float,
        waited: float,
        tier_times: dict[str, float | None] | None = None,
    ) -> SaveMetrics:
        metrics = SaveMetrics.of(step, blocked, upload, nbytes, waited, **(tier_times or {}))
        self._committed.add([step])
        self._record(metrics)
        return metrics

    def _record(self, metrics: SaveMetrics) -> None:
        with self._lock:
            self.metrics.append(metrics)
        log.info("%s", metrics)
        on_saved = self.on_saved
        if on_saved is not None:
            try:
                on_saved(metrics)
            except Exception:
                log.exception("on_saved callback failed for step %d", metrics.step)

    def _held_ok(self, inflight: InFlight) -> SaveMetrics:
        """Bookkeeping of a save held in memory only (no commit)."""
        metrics = SaveMetrics.of(
            inflight.step, inflight.blocked_s, 0.0, inflight.nbytes, inflight.waited_s,
            **inflight.tier_times(), to_s3=False,
        )  # fmt: skip
        self._record(metrics)
        return metrics

    def _failed(self, step: int, exc: BaseException) -> None:
        error = unwrap(exc)
        name = checkpoint_name(step)
        if isinstance(error, CheckpointExistsError):
            log.warning("%s was committed by someone else; not saved", name)
            self._committed.add([step])
            return
        # an s3ckpt error says what went wrong in its message (its traceback at DEBUG)
        expected = isinstance(error, S3CkptError)
        log.error(
            "background save of %s failed: %s", name, error, exc_info=None if expected else error
        )
        log.debug("background save of %s failed", name, exc_info=error)
        if hasattr(error, "add_note"):
            error.add_note(f"CheckpointManager: the background save of {name} failed")
        with self._lock:
            if self._failure is None:  # the first failure is the one worth raising
                self._failure = error

    def raise_failure(self) -> None:
        """Raise the first failure since the last call, if any (once)."""
        with self._lock:
            error, self._failure = self._failure, None
        if error is not None:
            raise error
