"""``Saving``: the save path of a :class:`~s3ckpt.CheckpointManager`, from ``save`` to the
background save started (or the synchronous ``dcp.save`` done).

It owns what a save decides and leaves behind: the skip-or-wait policy (``if_busy``,
agreed across ranks), whether a committed step is saved over (``overwrite``, a rollback's
abandoned steps), the one save in flight, and the :class:`~s3ckpt.manager.ledger.SaveLedger`
that records each save as it ends (metrics, ``on_saved``, committed steps, the failure
raised once by :meth:`Saving.settle`). The background saver, the memory tier and
the committed steps are the manager's, handed in at construction.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch.distributed.checkpoint as dcp

from s3ckpt.background.ranks import Ranks
from s3ckpt.background.saver import BackgroundSaver, state_bytes
from s3ckpt.catalog.run_retention import RunRetention
from s3ckpt.config import S3URI, S3Config
from s3ckpt.dcp.compat import unwrap
from s3ckpt.dcp.failure import reraise as _reraise
from s3ckpt.dcp.writer import S3StorageWriter
from s3ckpt.errors import CheckpointExistsError
from s3ckpt.manager import memory_tier as tiering
from s3ckpt.manager.committed import CommittedSteps
from s3ckpt.manager.ledger import InFlight, SaveLedger
from s3ckpt.manager.policy import IfBusy, SaveMetrics, checkpoint_name
from s3ckpt.tier.options import MemoryTier
from s3ckpt.tier.rank import RankTier

log = logging.getLogger("s3ckpt.manager")


class Saving:
    """One manager's saves: at most one in flight, each recorded as it ends.

    Args:
        location, config: the run's ``s3://bucket/run`` and its connection.
        ranks: the ranks that save together.
        committed: the steps known committed (shared with the load path).
        retention: the run's retention, on rank 0 (else None): after a synchronous save,
            applied here (a background save's engine applies it).
        saves: the background saver (None: ``async_mode="sync"``, ``dcp.save`` here).
        tier: this rank's memory tier, or None.
        memory_tier, if_busy, overwrite, writer_options, on_saved, max_metrics: the
            manager's options of the same names.
    """

    def __init__(
        self,
        location: S3URI,
        config: S3Config,
        ranks: Ranks,
        committed: CommittedSteps,
        retention: RunRetention | None,
        saves: BackgroundSaver | None,
        tier: RankTier | None,
        *,
        memory_tier: MemoryTier | None,
        if_busy: IfBusy,
        overwrite: bool,
        writer_options: dict[str, Any],
        on_saved: Callable[[SaveMetrics], None] | None,
        max_metrics: int,
    ) -> None:
        self._location, self._config, self._ranks = location, config, ranks
        self._committed, self._saves, self._tier = committed, saves, tier
        self._memory_tier = memory_tier
        self.if_busy, self.overwrite, self.writer_options = if_busy, overwrite, writer_options
        self._retention = retention
        self.ledger = SaveLedger(committed, max_metrics, on_saved)
        self._inflight: InFlight | None = None

    @property
    def busy(self) -> bool:
        """Whether this rank's last save is still uploading."""
        inflight = self._inflight
        return inflight is not None and not inflight.done.is_set()

    def save(self, step: int, state_dict: dict[str, Any], s3: bool | None) -> bool:
        """``CheckpointManager.save`` once the manager is known open, in its own process."""
        name = checkpoint_name(step)
        started = time.perf_counter()
        if self.if_busy == "skip" and self._ranks.any(self.busy):
            log.info("skipped %s: the previous save is still uploading", name)
            return False
        self.settle()  # from here on, every rank has the same view of what is committed
        waited = time.perf_counter() - started
        to_s3 = tiering.goes_to_s3(self._memory_tier, step, s3)
        if self._saves is not None:  # ranks that disagree fail here, before any collective
            try:  # that depends on where the step goes (the committed check's)
                self._saves.ready(name, f"step {step}, {'to S3' if to_s3 else 'memory only'}")
            except BaseException as exc:
                _reraise(exc)
        writer = None
        if to_s3:
            replace = self.overwrite or self._committed.replaces(step)
            if not replace and self._committed.includes(step):
                log.info("%s is already committed; not saved again", name)
                return False
            writer = self._writer(step, replace)
        if self._saves is None:
            assert writer is not None
            return self._save_sync(step, state_dict, writer, started, waited)
        hold = None if self._tier is None else self._tier.hold(step)
        try:
            future, failure = self._saves.start(state_dict, writer, name, hold=hold)
        except BaseException as exc:
            _reraise(exc, f"saving {name}")
        now = time.perf_counter()
        inflight = InFlight(
            step, future, now, now - started, waited, to_s3=to_s3,
            nbytes=hold.nbytes if hold is not None else 0,
        )  # fmt: skip
        self._inflight = inflight
        if hold is not None:
            tiering.time_the_copies(hold, inflight)
        ledger = self.ledger
        future.add_done_callback(lambda _: ledger.finished(inflight))
        if failure is not None:
            _reraise(failure, f"saving {name}")
        return True

    def settle(self) -> SaveMetrics | None:
        """Wait for the save in flight, then raise its failure (once) if it failed; the
        metrics of the last save started (None if there was none or it failed)."""
        inflight = self._inflight
        if inflight is not None and not inflight.done.is_set():
            with self._saves.hurried() if self._saves is not None else contextlib.nullcontext():
                inflight.done.wait()
        try:
            self.ledger.raise_failure()
        except Exception as exc:
            _reraise(exc, "the background save")
        return inflight.metrics if inflight is not None else None

    def _writer(self, step: int, replace: bool) -> S3StorageWriter:
        uri = str(self._location.child(checkpoint_name(step)))  # the manager's own name
        return S3StorageWriter(uri, config=self._config, overwrite=replace, **self.writer_options)

    def _save_sync(
        self, step: int, state: dict[str, Any], writer: S3StorageWriter, t0: float, waited: float
    ) -> bool:
        started = time.perf_counter()
        try:
            metadata = dcp.save(
                state,
                storage_writer=writer,
                process_group=self._ranks.group,
                no_dist=not self._ranks.distributed,
            )
        except BaseException as exc:
            if not isinstance(unwrap(exc), CheckpointExistsError):
                uri = str(self._location.child(self._committed.name(step)))
                _reraise(exc, f"saving {uri}")
            log.warning("%s was committed by someone else; not saved", checkpoint_name(step))
            return False
        elapsed = time.perf_counter() - started
        nbytes = state_bytes(metadata)
        self.ledger.committed_ok(step, nbytes, time.perf_counter() - t0, elapsed, waited)
        if self._retention is not None and writer.location is not None:
            self._retention.after_commit(writer.location)
        return True
