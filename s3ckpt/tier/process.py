"""``TieredCheckpointProcess``: the memory tier for scripts that call ``dcp.async_save``.

``CheckpointManager(memory_tier=...)`` names the steps, decides which go to S3 and loads
them itself. Scripts that keep their own S3 layout and call ``dcp.async_save`` /
``dcp.load`` (and the trainers built that way) get the same tier from this one object,
which takes the place of ``dcp.async_save`` and of the first step of a restore::

    tiered = TieredCheckpointProcess("s3://ckpt/run", MemoryTier(keep=2, s3_every=10))
    for step in ...:
        if step % 5 == 0:
            uri = f"s3://ckpt/run/{s3ckpt.step_name(step)}"  # step-0000000300, as the manager names it
            writer = S3StorageWriter(uri) if tiered.memory_tier.to_s3(step) else None
            tiered.async_save(state_dict, step, storage_writer=writer)
    ...
    # after a restart, on every rank:
    committed = s3ckpt.catalog.run_steps("s3://ckpt/run")  # any step-<digits> name is a step
    s3_latest = committed.latest()
    restored = tiered.restore_latest(state_dict, s3_latest=s3_latest)
    if restored is None and s3_latest is not None:
        name = committed.names[s3_latest]  # the name it is committed under
        dcp.load(state_dict, storage_reader=S3StorageReader(f"s3://ckpt/run/{name}"))

The lifecycle:

1. **Construct** on every rank at the same point (as :class:`~s3ckpt.CheckpointProcess`):
   one all-gather of node names lays out the replicas, the rank's checkpoint process
   starts (not waited for: :meth:`prepare` does), and with replicas a gloo group of the
   same ranks is made for the restore's fetches (never the loop's own groups).
2. **Save** (:meth:`async_save`): wait for the save in flight, copy the state into the
   rank's next memory slot (the only part the loop waits for); the checkpoint process
   then records it (``held``), sends it to its replica peers (``replicated``) and, with a
   writer, uploads it from the same memory (``done``): no second copy.
3. **Restore** (:meth:`restore_latest`): the newest step every rank can rebuild from
   memory intact, agreed across ranks, not older than the newest committed S3 step the
   caller names; None when S3 is the place to load from (:mod:`s3ckpt.tier.restore`).
4. **Close**: wait for the save in flight, stop the process; the held copies stay (they
   are what a restarted process restores from).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import CancelledError, Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from s3ckpt.background.process import DEFAULT_TIMEOUT_S, check_usable
from s3ckpt.background.ranks import Ranks
from s3ckpt.background.saver import BackgroundSaver
from s3ckpt.catalog.steps import step_name
from s3ckpt.config import S3URI, check_key_room
from s3ckpt.dcp.failure import reraise
from s3ckpt.dcp.writer import longest_name
from s3ckpt.errors import ConfigError, InvalidURIError
from s3ckpt.tier.options import MemoryTier
from s3ckpt.tier.rank import RankTier
from s3ckpt.tier.restore import Restored

log = logging.getLogger("s3ckpt.tier")


@dataclass(frozen=True)
class _Intent:
    """What every rank's save must agree on."""

    step: int
    uploads: bool

    def __str__(self) -> str:
        return f"step {self.step}, {'uploaded' if self.uploads else 'held only'}"


@dataclass(frozen=True)
class TierSave:
    """One save of a :class:`TieredCheckpointProcess`: ``held`` resolves once the copy is
    recorded in memory, ``replicated`` once its replicas landed on every peer (at once
    without peers), ``done`` with DCP's ``Metadata`` once it is uploaded (``None`` when
    it was held only), or with the save's error."""

    step: int
    to_s3: bool
    held: Future[None]
    replicated: Future[None]
    done: Future[Any]

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the whole save; DCP's ``Metadata`` (None if held only), or raise the
        save's s3ckpt error: the one a rank raised inside DCP's ``CheckpointException``,
        else a :class:`~s3ckpt.errors.CheckpointError` naming the failure, chained to it
        (as :class:`~s3ckpt.CheckpointManager` raises). A ``timeout`` that runs out raises
        ``TimeoutError`` (the save goes on), a cancelled save ``CancelledError``."""
        try:
            return self.done.result(timeout)
        except (FutureTimeoutError, CancelledError):
            raise
        except BaseException as exc:
            reraise(exc, f"the save of step {self.step}")


class TieredCheckpointProcess:
    """The memory tier (:class:`~s3ckpt.MemoryTier`) in front of S3, for ``dcp.async_save``
    users: this rank's checkpoint process, saving into shared memory that outlives it.

    Args:
        run: the run's S3 location (``s3://bucket/run``): the copies of one run are kept
            apart from another's, and a restarted process finds them by it.
        memory_tier: what to keep and where; its root is checked here.
        process_group: the ranks that save together (default: the default group, when
            torch.distributed is initialized; else this process alone). Every rank of it
            constructs this object, saves and restores together.
        pin_memory, timeout_s, nice: as for :class:`~s3ckpt.CheckpointProcess`.
    """

    def __init__(
        self,
        run: str,
        memory_tier: MemoryTier,
        process_group: dist.ProcessGroup | None = None,
        *,
        pin_memory: bool | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        nice: int | None = None,
    ) -> None:
        if not isinstance(memory_tier, MemoryTier):
            raise ConfigError(f"memory_tier must be a MemoryTier, got {memory_tier!r}")
        if not isinstance(run, str) or not run:
            raise ConfigError(f"run must name the run's S3 location, got {run!r}")
        _check_step_keys(run)
        self.memory_tier = memory_tier
        ranks = Ranks(process_group)
        self.world, self.rank = ranks.world, ranks.rank
        self._tier = RankTier(
            memory_tier, run, self.rank, self.world, ranks.gather, process_group, timeout_s
        )
        try:
            self._saves = BackgroundSaver(
                "process", process_group, memory_slots=self._tier.copies.slots,
                slot_limit=memory_tier.max_bytes, pin_memory=pin_memory,
                timeout_s=timeout_s, nice=nice,
            )  # fmt: skip
        except BaseException:
            self._tier.close()
            raise
        self._inflight: TierSave | None = None
        self._closed = False
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"TieredCheckpointProcess({self._tier.run!r}, rank={self.rank})"

    @property
    def pid(self) -> int | None:
        """The checkpoint process's pid."""
        process = self._saves.process
        return process.pid if process is not None else None

    # -- saving ----------------------------------------------------------------------------

    def async_save(
        self,
        state_dict: dict[str, Any],
        step: int,
        *,
        storage_writer: Any = None,
        planner: Any = None,
    ) -> TierSave:
        """Hold ``state_dict`` in memory as ``step`` and, with ``storage_writer``, upload
        it from there too; returns once copied. Every rank calls it together, each with a
        writer or each without one (``memory_tier.to_s3(step)`` says which by the
        tier's ``s3_every``). The previous save's outcome is its own :class:`TierSave`'s;
        this one waits for it to finish first."""
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be an int >= 0, got {step!r}")
        self.wait()
        uploads = storage_writer is not None
        self._saves.ready(f"step {step}", _Intent(step, uploads))
        hold = self._tier.hold(step)
        done, failure = self._saves.start(
            state_dict, storage_writer, f"step {step}", hold=hold, planner=planner
        )
        save = TierSave(step, uploads, hold.held, hold.replicated, done)
        self._inflight = save
        if hold.request.replicate is None:
            _resolve_with(hold.replicated, hold.held)
        if failure is not None:
            raise failure
        return save

    def wait(self) -> None:
        """Wait for the save in flight to finish (its outcome is its :class:`TierSave`'s)."""
        save, self._inflight = self._inflight, None
        if save is not None and not save.done.done():
            with self._saves.hurried():
                save.done.exception()

    def prepare(self, timeout_s: float | None = None) -> None:
        """Wait until this rank's checkpoint process, started by the constructor without
        waiting, is ready to save (:meth:`CheckpointProcess.prepare`; optional)."""
        self._check_open()
        self._saves.prepare(timeout_s)

    # -- what is held, and restoring -------------------------------------------------------

    def held_steps(self) -> list[int]:
        """Steps every rank holds a complete copy of, ascending (one all-gather; every rank
        calls it, after its save in flight finished)."""
        self._check_open()
        self.wait()
        return self._tier.held_steps()

    def replicated_steps(self) -> list[int]:
        """Steps every rank holds whose copies also reached every replica peer on another
        node, ascending (one all-gather); what survives the loss of a node."""
        self._check_open()
        self.wait()
        return self._tier.replicated_steps()

    def restore_latest(
        self, state_dict: dict[str, Any], s3_latest: int | None = None, *, planner: Any = None
    ) -> Restored | None:
        """Load into ``state_dict`` the newest step every rank can rebuild from memory
        intact, when it is at least ``s3_latest`` (the newest step committed to S3, if
        any; S3 wins when it is newer). Returns where it came from and what it cost, or
        None: load ``s3_latest`` from S3 then (the copies above it are dropped; without
        an ``s3_latest``, ``state_dict`` was left as it was). Every rank calls it."""
        self._check_open()
        self.wait()
        restored = self._tier.restore(state_dict, s3_latest, planner=planner)
        went_on_from = restored.step if restored is not None else s3_latest
        if went_on_from is not None:
            self._tier.discard_above(went_on_from)
        if restored is not None:
            log.info(
                "restored step %d from memory in %.2f s (%.3f s to choose it)",
                restored.step, restored.load_s, restored.select_s,
            )  # fmt: skip
        return restored

    def discard_above(self, step: int) -> None:
        """The run goes on from ``step`` (a rollback, or a load from S3 the tier did not
        choose): this rank's copies of later steps are dropped, and the saves from now on
        carry a new lineage. Every rank calls it, with the same step: a rank that did
        not would save copies no restore assembles with the others' (S3 then)."""
        self._check_open()
        self._tier.discard_above(step)

    # -- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the save in flight, stop the process and the fetch group; idempotent.
        The held copies stay in shared memory."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return
        try:
            self.wait()
        finally:
            try:
                self._saves.close()
            finally:
                self._tier.close()

    def __enter__(self) -> TieredCheckpointProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        check_usable(self, self._closed, self._pid)


def _check_step_keys(run: str) -> None:
    """Refuse a run whose steps' checkpoints (``<run>/step-<N:010d>``, as the manager and
    the examples name them) would hold keys longer than S3 takes."""
    try:
        location = S3URI.parse(run, require_prefix=False)
    except InvalidURIError:
        return  # a run named otherwise only keys the held copies
    check_key_room(location, f"{step_name(0)}/{longest_name()}", "run")


def _resolve_with(target: Future[None], source: Future[None]) -> None:
    """Nothing to replicate: ``target`` resolves as ``source`` does."""

    def copy(done: Future[None]) -> None:
        error = done.exception()
        try:
            if error is not None:
                target.set_exception(error)
            else:
                target.set_result(None)
        except InvalidStateError:  # failed with the save already
            pass

    source.add_done_callback(copy)
