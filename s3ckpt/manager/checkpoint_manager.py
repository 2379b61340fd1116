"""``CheckpointManager``: what a training loop calls to checkpoint by step, in the background.

The loop blocks only while the state is copied to host memory (with CUDA, into pinned
buffers: non-blocking copies, then a synchronize); the upload and the commit run while
training goes on, by default in the rank's persistent checkpoint process, which reads the
copy from memory it shares with the loop (process mode: the loop's interpreter does
nothing for the upload), or on a worker thread (thread mode), both run by
:class:`~s3ckpt.background.saver.BackgroundSaver`. Neither asks anything of the script:
no ``if __name__ == "__main__":`` guard, no process group for a single process. The
rules:

* **Names.** Step ``N`` is saved to ``<uri>/step-<N:010d>`` (:func:`s3ckpt.step_name`),
  zero-padded so that plain LIST order is step order. ``steps()`` lists the committed
  ones (one LIST, on rank 0), reading any ``step-<digits>`` name as a step
  (:func:`s3ckpt.step_of`: ``step-300`` from another writer is step 300, loaded from
  there); what is not read as a step is logged once (:mod:`s3ckpt.manager.committed`).
* **At most one save in flight.** The host memory of the copy is kept and reused from
  save to save, so a save cannot stage before the previous upload is done:
  ``if_busy="wait"`` (default) waits for it, ``"skip"`` skips the new save. With several
  ranks the skip decision is agreed (one all-gather), so no rank starts a save alone.
* **Failures are never lost.** A failed background save is logged when it fails and raised,
  as the s3ckpt error (:func:`s3ckpt.unwrap`), by the next ``save``/``wait``/``close``/``load``.
  A checkpoint process that dies (killed, out of memory) fails its save with
  :class:`~s3ckpt.errors.CheckpointProcessError`; the next save starts a fresh one.
  A rank whose copy to host memory fails raises at once and still starts its save, which
  fails in planning, so every rank raises at its next call and none waits in a collective.
  Whatever fails, the manager raises an s3ckpt error (``except Exception`` catches it):
  DCP's ``CheckpointException`` (a ``BaseException``) and any other error a save or load
  meets become the s3ckpt error inside, or a :class:`~s3ckpt.errors.CheckpointError`
  whose first line names them, chained to the original.
* **Existing steps are kept**: re-saving a committed step (a resumed loop re-running it,
  seen committed by this manager or by an earlier run: :mod:`s3ckpt.manager.committed`
  says how that is found at little cost) is skipped with an INFO line and returns False,
  unless ``overwrite=True`` (then replaced atomically).
* **Rollbacks**: after ``load(step)`` of an older step, the checkpoints above it are the
  abandoned run's. The first commit supersedes them: ``steps()``/``load_latest`` skip
  them and retention deletes them (:mod:`s3ckpt.catalog.retention`). A step above the
  one loaded is saved over the abandoned run's checkpoint there, atomically, so a
  restart never resumes from the run rolled back from.
* **Retention** (``keep_last``, ``keep_every``) runs on rank 0 after each commit, where the
  save ran (the checkpoint process, the save thread; after a synchronous save, here), once
  the commit is reported (:class:`s3ckpt.catalog.run_retention.RunRetention`); it never
  deletes the checkpoint just written, and its failures are logged, not raised.
* **Metrics**: each commit gives a :class:`SaveMetrics`, logged at INFO on
  ``s3ckpt.manager``, kept in ``metrics`` and passed to ``on_saved``.
* **Memory tier** (``memory_tier=MemoryTier(...)``, :mod:`s3ckpt.tier`, wired here by
  :mod:`s3ckpt.manager.memory_tier`): every save is also held in shared memory on the
  node (the copy the upload reads, so no second copy), and only steps that
  ``MemoryTier.s3_every`` divides go to S3. ``load_latest`` restores from memory when
  every rank holds an intact copy at least as new as S3's newest step, agreed across
  ranks, and from S3 otherwise; ``last_restore`` says which and what it cost.

The class is the facade of these rules: it starts and closes what a run holds (the
background saver, the memory tier) and owns the lifecycle (``prepare``,
``wait``, ``close``, the context manager, the process it was made in); the save path is
:class:`~s3ckpt.manager.saving.Saving`'s and the load path
:class:`~s3ckpt.manager.loading.Loading`'s, each handed what it needs at construction.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from s3ckpt.background.process import DEFAULT_TIMEOUT_S
from s3ckpt.background.ranks import Ranks
from s3ckpt.background.saver import BackgroundSaver, state_bytes
from s3ckpt.catalog.run_retention import RunRetention
from s3ckpt.config import S3URI, S3Config, check_key_room, make_config
from s3ckpt.dcp.compat import group_timeout
from s3ckpt.dcp.writer import longest_name
from s3ckpt.errors import CheckpointError
from s3ckpt.manager import memory_tier as tiering
from s3ckpt.manager.committed import CommittedSteps
from s3ckpt.manager.loading import Loading
from s3ckpt.manager.policy import AsyncMode, IfBusy, SaveMetrics, checkpoint_name, validate_options
from s3ckpt.manager.saving import Saving
from s3ckpt.s3.client import prepare_client
from s3ckpt.tier.options import MemoryTier
from s3ckpt.tier.restore import Restored

log = logging.getLogger("s3ckpt.manager")


class CheckpointManager:
    """Save, list, retain and restore the checkpoints of one training run under ``uri``.

    Args:
        uri: ``s3://bucket/run``; step ``N`` is saved to ``<uri>/step-<N:010d>``.
        endpoint_url, config: connection and tuning, as for :class:`~s3ckpt.S3Config`.
        **options: :class:`~s3ckpt.S3Config`'s fields by name, as for the two above.
        keep_last, keep_every: retention after each commit (rules in :mod:`s3ckpt.catalog.retention`,
            the same as ``s3ckpt prune``'s; ``keep_last=0`` keeps only the newest and the
            ``keep_every`` steps); ``None`` for both keeps everything.
        if_busy: ``"wait"`` for the previous upload (default), or ``"skip"`` this save.
        async_mode: ``"process"`` (default: the rank's checkpoint process, started by
            the constructor without waiting for it, so that it is ready by the first
            save; :meth:`prepare` waits for it), ``"thread"`` (a worker thread of this
            process) or ``"sync"`` (plain ``dcp.save``).
        overwrite: replace an already committed step instead of skipping the save.
        process_group: the ranks that checkpoint together (default: the default group). With
            several ranks, every rank of the group constructs the manager at the same point:
            the checkpoint processes meet there (thread mode creates a gloo group there), so
            background saves never interleave their collectives with the training loop's.
        on_saved: called with each commit's :class:`SaveMetrics` (on a background thread).
        max_metrics: how many recent :class:`SaveMetrics` ``metrics`` keeps.
        writer_options: more keywords for every :class:`~s3ckpt.S3StorageWriter`
            (``{"compression": "zstd"}``...).
        reader_options: more keywords for every :class:`~s3ckpt.S3StorageReader`
            (``{"trust_pickles": True}`` for state holding custom classes...).
        memory_tier: hold every save in shared memory on the node too, and write to S3
            only the steps it says (:class:`~s3ckpt.MemoryTier`; process mode only). Its
            root is checked at construction.
        strict: a load raises :class:`~s3ckpt.errors.StateMismatchError`, before any byte
            is loaded, when a saved entry would be left out (no rank's state takes it) or
            loaded with a dtype or shape conversion. ``False`` (the default): such a load
            goes ahead and logs what it left out or converted as one warning (logger
            ``s3ckpt.dcp.load_report``). Either way, optimizers placed in the state as
            themselves get their saved state (:mod:`s3ckpt.dcp.optimizer_state`).
    """

    def __init__(
        self,
        uri: str,
        *,
        endpoint_url: str | None = None,
        config: S3Config | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        if_busy: IfBusy = "wait",
        async_mode: AsyncMode = "process",
        overwrite: bool = False,
        process_group: dist.ProcessGroup | None = None,
        on_saved: Callable[[SaveMetrics], None] | None = None,
        max_metrics: int = 1000,
        writer_options: dict[str, Any] | None = None,
        reader_options: dict[str, Any] | None = None,
        memory_tier: MemoryTier | None = None,
        strict: bool = False,
        **options: Any,
    ) -> None:
        validate_options(keep_last, keep_every, if_busy, async_mode)
        tiering.check_mode(memory_tier, async_mode)
        self.location = S3URI.parse(uri, require_prefix=False)
        self.config = make_config(config, endpoint_url=endpoint_url, **options)
        self.async_mode = async_mode
        writer_options = dict(writer_options or {})
        spread = writer_options.get("spread_prefixes", 0)  # every step's keys must fit
        check_key_room(self.location, f"{checkpoint_name(0)}/{longest_name(spread)}", "run")
        self._ranks = Ranks(process_group)
        if self._ranks.rank == 0:  # the rank that lists S3 first, at a load or the first save
            prepare_client(self.config)
        if self._ranks.world == 1:  # DCP warns on each single-process call; here it is meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        self.memory_tier = memory_tier
        timeout_s = _collective_timeout(self.config, process_group)
        self._tier = tiering.rank_tier(
            memory_tier, self.location, self._ranks, process_group, timeout_s
        )
        retention = RunRetention(self.location, self.config, keep_last, keep_every)
        retains = retention if retention.enabled and self._ranks.rank == 0 else None
        # a save's future brings back only the state's bytes (for its metrics), not DCP's
        # metadata: the checkpoint process would send it to this process to unpickle
        self._saves = (
            None if async_mode == "sync"
            else BackgroundSaver(
                async_mode, process_group, reply=state_bytes, config=self.config,
                retention=retains, timeout_s=timeout_s,
                **tiering.saver_memory(self._tier, memory_tier),
            )
        )  # fmt: skip
        self._committed = CommittedSteps(self.location, self.config, self._ranks)
        self._saving = Saving(
            self.location, self.config, self._ranks, self._committed, retains,
            self._saves, self._tier, memory_tier=memory_tier, if_busy=if_busy,
            overwrite=overwrite, writer_options=writer_options, on_saved=on_saved,
            max_metrics=max_metrics,
        )  # fmt: skip
        self._loading = Loading(
            self.location, self.config, self._ranks, self._committed, self._tier,
            strict=strict, reader_options=dict(reader_options or {}),
        )  # fmt: skip
        self._closed = False
        self._pid = os.getpid()  # its threads and its saves in flight belong to this process

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.location)!r}, async_mode={self.async_mode!r})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self.close()
        except BaseException:
            if exc is None:
                raise
            # an exception is already on its way out: report this one, do not replace it
            log.exception("closing %r while handling another error failed", self)

    # -- options the save and load paths own ------------------------------------------------

    @property
    def on_saved(self) -> Callable[[SaveMetrics], None] | None:
        """Called with each commit's :class:`SaveMetrics` (on a background thread); may be
        replaced at any time: each save reads it as it ends."""
        return self._saving.ledger.on_saved

    @on_saved.setter
    def on_saved(self, on_saved: Callable[[SaveMetrics], None] | None) -> None:
        self._saving.ledger.on_saved = on_saved

    @property
    def overwrite(self) -> bool:
        """Whether a save replaces an already committed step; may be changed between saves."""
        return self._saving.overwrite

    @overwrite.setter
    def overwrite(self, overwrite: bool) -> None:
        self._saving.overwrite = overwrite

    @property
    def if_busy(self) -> IfBusy:
        """What a save asked for while the last one uploads does; may be changed between saves."""
        return self._saving.if_busy

    @if_busy.setter
    def if_busy(self, if_busy: IfBusy) -> None:
        self._saving.if_busy = if_busy

    @property
    def writer_options(self) -> dict[str, Any]:
        """Keyword arguments for each save's :class:`~s3ckpt.S3StorageWriter`."""
        return self._saving.writer_options

    @writer_options.setter
    def writer_options(self, options: dict[str, Any]) -> None:
        self._saving.writer_options = options

    @property
    def strict(self) -> bool:
        """Whether a load checks the state against the checkpoint first; may be changed between loads."""
        return self._loading.strict

    @strict.setter
    def strict(self, strict: bool) -> None:
        self._loading.strict = strict

    @property
    def reader_options(self) -> dict[str, Any]:
        """Keyword arguments for each load's :class:`~s3ckpt.S3StorageReader`."""
        return self._loading.reader_options

    @reader_options.setter
    def reader_options(self, options: dict[str, Any]) -> None:
        self._loading.reader_options = options

    @property
    def metrics(self) -> deque[SaveMetrics]:
        """The :class:`SaveMetrics` of the most recent saves (``max_metrics`` of them)."""
        return self._saving.ledger.metrics

    @property
    def last_restore(self) -> Restored | None:
        """Where the last ``load_latest`` restored from and what it cost; None before one."""
        return self._loading.last_restore

    # -- names and listing ---------------------------------------------------------------

    def uri_of(self, step: int) -> str:
        """Where step ``step`` is committed, or would be saved: ``<uri>/step-<N:010d>``,
        unless the last listing found it only under another name (``step-300``, written
        by another tool: :func:`s3ckpt.step_of`). No request."""
        return self._loading.uri_of(step)

    def steps(self) -> list[int]:
        """Committed steps, ascending: one LIST on rank 0, broadcast to the other ranks.

        Steps superseded by a rollback (a lower step committed after them, see
        :mod:`s3ckpt.catalog.retention`) are left out: training does not go on from them.
        """
        self._check_process()
        return self._committed.current()

    def latest_step(self) -> int | None:
        """The highest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    @property
    def busy(self) -> bool:
        """Whether this rank's last save is still uploading."""
        return self._saving.busy

    # -- load ----------------------------------------------------------------------------

    def load_latest(self, state_dict: dict[str, Any]) -> int | None:
        """Load the highest committed step into ``state_dict`` and return it (None, and
        ``state_dict`` untouched, when nothing is committed yet).

        Loads in place, Stateful objects included (DCP calls their ``load_state_dict``).
        The step returned is the one passed to the ``save`` restored: if the loop saves
        after training step ``N``, resume at ``N + 1``. With a memory tier, a step every
        rank holds intact in memory, at least as new as S3's newest, is restored from
        memory (:mod:`s3ckpt.tier.restore`); ``last_restore`` says where it came from.
        """
        self._check_process()
        self._settle()
        return self._loading.load_latest(state_dict)

    def load(self, step: int, state_dict: dict[str, Any]) -> None:
        """Load committed ``step`` into ``state_dict`` (to roll back, for instance)."""
        self._check_process()
        self._settle()
        self._loading.load(step, state_dict)

    def held_steps(self) -> list[int]:
        """Steps every rank holds a complete copy of in the memory tier, ascending (one
        all-gather; every rank calls it). Empty without a memory tier."""
        self._check_process()
        if self._tier is None:
            return []
        self._settle()
        return self._tier.held_steps()

    def replicated_steps(self) -> list[int]:
        """Steps held by every rank whose copies also reached every replica peer on
        another node, ascending (one all-gather; every rank calls it). What survives the
        loss of a node; equal to ``held_steps()`` on one node (nothing to replicate to)."""
        self._check_process()
        if self._tier is None:
            return []
        self._settle()
        return self._tier.replicated_steps()

    # -- save ----------------------------------------------------------------------------

    def save(self, step: int, state_dict: dict[str, Any], *, s3: bool | None = None) -> bool:
        """Stage ``state_dict`` and upload it as ``step`` in the background.

        Returns True once staged, False when skipped (busy under ``if_busy="skip"``, or
        ``step`` already committed). A previous save's failure is raised here first, and
        this step is then not saved: call ``save`` again to save it.

        In process mode, a value the checkpoint process could not unpickle (a class or
        function of the script's ``__main__`` or defined in a function, a lambda) raises
        :class:`~s3ckpt.errors.UnpicklableStateError` naming its key, before anything is
        copied or uploaded (:mod:`s3ckpt.background.rebuild`).

        With a memory tier the copy is also held in memory, and uploaded only if ``s3``
        says so (default: ``MemoryTier.to_s3(step)``); every rank must pass the same
        (ranks that do not all raise :class:`~s3ckpt.errors.ConfigError`).
        """
        if self._closed:
            raise CheckpointError(f"{self!r} is closed")
        self._check_process()
        return self._saving.save(step, state_dict, s3)

    # -- waiting and closing ---------------------------------------------------------------

    def prepare(self, timeout_s: float | None = None) -> None:
        """Wait until the checkpoint process (process mode) is ready to save. Optional:
        the constructor starts it without waiting, and a save made before it is ready
        waits only for the rest of its start-up. Call it to know, before the loop starts,
        that the first save will find the process ready, or that it cannot start:
        :class:`~s3ckpt.errors.CheckpointProcessError` then (also after ``timeout_s``
        seconds), and the next save starts a fresh process. Returns at once in thread and
        sync modes."""
        self._check_process()
        if self._closed:
            raise CheckpointError(f"{self!r} is closed")
        if self._saves is not None:
            self._saves.prepare(timeout_s)

    def wait(self) -> SaveMetrics | None:
        """Wait for the save in flight and the retention after it; raise a failed save's error.

        Returns the metrics of the save waited for (None if there was none or it failed).
        """
        self._check_process()
        metrics = self._saving.settle()
        if self._saves is not None:
            self._saves.wait_retained()
        return metrics

    def close(self) -> None:
        """Wait for everything in flight, then release the staging buffers; idempotent."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return  # a forked child: the threads, buffers and saves are its parent's
        try:
            self.wait()
        finally:
            try:
                if self._saves is not None:
                    self._saves.close()
            finally:
                if self._tier is not None:
                    self._tier.close()

    # -- helpers ---------------------------------------------------------------------------

    def _check_process(self) -> None:
        """A forked child has none of the manager's threads: its saves would never run."""
        if os.getpid() != self._pid:
            raise CheckpointError(
                f"{self!r} was created in process {self._pid}, not in this one "
                f"({os.getpid()}): each process creates its own CheckpointManager"
            )

    def _settle(self) -> None:
        """Wait for the save in flight, then raise its failure (once) if it failed."""
        self._saving.settle()


__all__ = ["AsyncMode", "CheckpointManager", "IfBusy", "SaveMetrics", "checkpoint_name"]


_SAVE_MARGIN_S = 10.0  # a save's own work around its requests: staging, plans, metadata


def _collective_timeout(config: S3Config, group: dist.ProcessGroup | None) -> float:
    """How long a rank of a save waits for the others in a collective: as long as the
    job's own collectives wait, and as long as another rank's requests may take (its
    ``deadline_s``, one request's ``read_timeout`` past it, and a margin), so that a rank
    cut off from its peers ends the save everywhere within the deadline, not half an hour
    later (a new gloo group's timeout). Without a deadline, half an hour."""
    if config.deadline_s is None:
        return DEFAULT_TIMEOUT_S
    bound = config.deadline_s + config.read_timeout + _SAVE_MARGIN_S
    job = group_timeout(group) if dist.is_available() and dist.is_initialized() else None
    return max(bound, job or 0.0)
