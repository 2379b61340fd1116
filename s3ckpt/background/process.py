"""``CheckpointProcess``: one persistent checkpoint process per rank, fed from shared memory.

A background save that runs in the training process shares its interpreter: every Python
operation of the upload holds the GIL, and every small torch op of the loop waits for it
(docs/decisions/0002-manager-thread-mode-loop-cost.md). Here the loop's
process only copies the state into a :class:`~s3ckpt.background.arena.StagingArena` it
shares with its checkpoint process, and sends it a description of the copy; the process
runs ``dcp.save`` of it with the given writer. The lifecycle:

1. **Start.** The process is started when this object is constructed, which does not
   wait for it: a fresh interpreter running :mod:`s3ckpt.background.process_side`
   imports what a save runs and makes the S3 client of ``config`` while training goes on, at the
   trainer's priority, then answers ready (:meth:`prepare` waits for that; a save sent
   earlier waits in the process for what is left of its start-up). With
   several ranks, every rank constructs it at the same point: rank 0 opens a store the
   checkpoint processes meet at (at ``MASTER_ADDR``, else where the default group met),
   and the processes form a gloo group of their own. A process that dies before the group
   is formed ends the meeting on every rank (:mod:`~s3ckpt.background.meeting`).
2. **Save** (:meth:`async_save`): wait for the save in flight (the arena holds its copy),
   agree across ranks whether the processes must be started afresh, copy the state into
   the arena (the only part the loop waits for), send it; a future resolves with the
   save's DCP metadata, or its error.
3. **Failure.** A process that dies (killed, out of memory) fails its save at once with
   :class:`~s3ckpt.errors.CheckpointProcessError`; with several ranks, a failed save
   ends the processes of every rank (:mod:`~s3ckpt.background.process_side`), and the
   next save starts fresh ones on every rank, together. Nothing of a failed save is
   committed: the manifest is written last.
4. **Close** (:meth:`close`, or the interpreter's exit): wait for the save in flight
   and the retention after it, stop the process (one still starting is killed at once; a ready one exits when asked,
   and is killed after a second if it has not), unmap the arena. The memory has no
   name anywhere, so nothing is left behind, whichever process ends first and however.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from s3ckpt.background.arena import StagingArena
from s3ckpt.background.arena_copy import ArenaCopy, copy_into_arena
from s3ckpt.background.channel import dumps_staged
from s3ckpt.background.meeting import MeetingWatch
from s3ckpt.background.protocol import CopyFailure, Hello, Meeting, SaveRequest
from s3ckpt.background.rebuild import ChildImports
from s3ckpt.background.trainer_side import TierHold, TrainerSide, process_niceness
from s3ckpt.dcp.compat import default_store_host
from s3ckpt.dcp.staging import plain_state_dict
from s3ckpt.errors import CheckpointProcessError, ConfigError

log = logging.getLogger("s3ckpt.background")

DEFAULT_TIMEOUT_S = 1800.0
NICE_VARIABLE = "S3CKPT_CHECKPOINT_NICE"


class CheckpointProcess:
    """The checkpoint process of this rank, and the shared memory saves are staged in.

    For ``dcp.async_save`` users, in place of it::

        process = CheckpointProcess()            # once; every rank, at the same point
        future = process.async_save(state_dict, storage_writer=S3StorageWriter(uri))
        ...
        future.result()                          # the DCP Metadata, or the save's error
        process.close()

    Args:
        process_group: the ranks that save together (default: the default group, when
            torch.distributed is initialized; else this process alone). It is used only
            to meet at construction and to agree, at each save, whether the checkpoint
            processes start afresh; saves run their collectives on a group of their own.
        pin_memory: page-lock the staging memory for fast device copies (default: whether
            CUDA is available).
        timeout_s: how long the checkpoint processes wait for each other in a collective.
        memory_slots: folders (in a tmpfs) to stage into instead of anonymous memory, one
            arena each, chosen per save (``slot``): the memory tier's slots
            (:mod:`s3ckpt.tier`), whose copies outlive the process.
        slot_limit: the most bytes a copy staged in a memory slot may take (the memory
            tier's ``max_bytes``): a larger state fails its save with
            :class:`~s3ckpt.errors.MemoryTierError` before a byte is copied.
        nice: how much lower the checkpoint process's CPU priority is than the trainer's
            while it saves (added to the trainer's nice value; default
            ``$S3CKPT_CHECKPOINT_NICE``, else :func:`default_niceness`: 10 where the
            trainer may raise a priority back, with ``CAP_SYS_NICE`` or ``RLIMIT_NICE``,
            else 0; 0: the same). Where the two want the same core, the training loop
            gets it, and the upload (or replication) goes on in the time the loop
            leaves; on a node with idle cores it changes nothing. Its start-up runs at
            the trainer's priority (the first save waits for it); where the trainer
            may raise it, the process runs at the trainer's priority again while the
            trainer waits for a save (the next save, ``wait``, ``close``) and while
            other work fills every core (:mod:`s3ckpt.background.priority`), where a
            lowered priority would starve the save
            (docs/decisions/0001-checkpoint-process-priority.md).
        config: the :class:`~s3ckpt.S3Config` the saves will use: the process makes its
            client as it starts, so the first save does not (optional).
        retention: applied by the process after each upload it commits, once the save's
            outcome is sent (:class:`~s3ckpt.catalog.run_retention.RunRetention`; the
            manager's ``keep_last`` and ``keep_every``, on rank 0).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        pin_memory: bool | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        memory_slots: Sequence[Path] = (),
        slot_limit: int | None = None,
        nice: int | None = None,
        config: Any = None,
        retention: Any = None,
    ) -> None:
        self._nice = _niceness(nice)
        self._config = config
        self._retention = retention
        self._group = process_group
        distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(process_group) if distributed else 1
        self.rank = dist.get_rank(process_group) if distributed else 0
        self._timeout_s = timeout_s
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._arenas = [
            StagingArena(pin=pin, root=Path(root), limit=slot_limit) for root in memory_slots
        ]
        if not self._arenas:
            self._arenas.append(StagingArena(pin=pin))
        self._store, self._address = self._meeting_place()
        self._generation = 0
        self._imports = ChildImports()
        self._side: TrainerSide | None = None
        self._save_ids = itertools.count()
        self._inflight: Future[Any] | None = None
        self._closed = False
        self._pid = os.getpid()
        self._start()
        _open.add(self)

    def __repr__(self) -> str:
        pid = self._side.pid if self._side is not None else None
        return f"CheckpointProcess(rank={self.rank}, pid={pid})"

    @property
    def pid(self) -> int | None:
        """The checkpoint process's pid (None once closed)."""
        return self._side.pid if self._side is not None else None

    def arena(self, slot: int = 0) -> StagingArena:
        """The staging memory of ``slot`` (the only one without memory slots)."""
        return self._arenas[slot]

    @property
    def ready(self) -> bool:
        """Whether the process has started and answered ready."""
        side = self._side
        return side is not None and side.ready

    def prepare(self, timeout_s: float | None = None) -> None:
        """Wait until the checkpoint process is ready to save (imports done, client made,
        with several ranks its group formed). Optional: a save does not need it; it lets
        a script know, before its loop starts, that the first save will not wait for the
        start-up, or that the process cannot start: then it raises
        :class:`~s3ckpt.errors.CheckpointProcessError` (as after ``timeout_s`` seconds),
        and the next save starts a fresh process."""
        self._check_open()
        side = self._side
        assert side is not None
        side.wait_ready(timeout_s)

    @property
    def staging_bytes(self) -> int:
        """Host memory held for staging."""
        return sum(arena.nbytes for arena in self._arenas)

    # -- saving ----------------------------------------------------------------------------

    def async_save(
        self, state_dict: dict[str, Any], *, storage_writer: Any, planner: Any = None
    ) -> Future[Any]:
        """Copy ``state_dict`` into shared memory, then save it from the checkpoint process
        with ``storage_writer``; returns once copied. Every rank calls it together."""
        self.wait_idle()
        self.refresh()
        staged = self.stage(state_dict)
        return self.submit(staged, storage_writer, planner)

    def wait_idle(self) -> None:
        """Wait for the save in flight to finish (its outcome is its future's)."""
        inflight = self._inflight
        if inflight is not None:
            try:
                if not inflight.done():
                    with self.hurried():
                        inflight.exception()
            finally:
                self._inflight = None

    def wait_retained(self) -> None:
        """Wait for the retention after the last upload (``retention``) to be done."""
        side = self._side
        if side is not None:
            with self.hurried():
                side.wait_retained()

    @contextlib.contextmanager
    def hurried(self) -> Iterator[None]:
        """While the trainer waits for this process's save: the process runs at the
        trainer's priority, where the trainer may raise a priority it lowered."""
        side = self._side
        if side is None:
            yield
            return
        side.hurry()
        try:
            yield
        finally:
            side.relax()

    def refresh(self, agree: Any = None) -> list[Any]:
        """Start fresh checkpoint processes where one is needed: this rank's died, or (with
        several ranks) a save failed on any rank. One all-gather with several ranks, which
        also carries ``agree``: every rank's, in rank order, is returned (what the caller
        checks the ranks agree on before a save starts)."""
        self._check_open()
        side = self._side
        needed = side is None or not side.healthy(self.world)
        agreed = [agree]
        if self.world > 1:
            flags: list[Any] = [None] * self.world
            dist.all_gather_object(flags, (needed, agree), group=self._group)
            needed = any(flag for flag, _ in flags)
            agreed = [value for _, value in flags]
        if needed:
            self._stop_side()
            self._generation += 1
            self._start()
        return agreed

    def stage(self, state_dict: dict[str, Any], slot: int = 0) -> ArenaCopy:
        """Copy ``state_dict`` into the arena of ``slot`` (the previous save must be
        finished). A value the checkpoint process could not unpickle (a class of
        ``__main__``, a lambda...) raises :class:`~s3ckpt.errors.UnpicklableStateError`
        naming its key, before anything is copied."""
        return copy_into_arena(self._arenas[slot], plain_state_dict(state_dict), self._imports)

    def submit(
        self,
        staged: ArenaCopy,
        writer: Any,
        planner: Any = None,
        *,
        hold: TierHold | None = None,
        reply: Callable[[Any], Any] | None = None,
        copy_failure: CopyFailure | None = None,
    ) -> Future[Any]:
        """Send a copy staged in the arena of ``hold.slot`` (else the first) to the
        checkpoint process; its save's future. With ``hold``, the process first records
        the copy as a memory-tier checkpoint (``hold.held`` resolves then), then exchanges
        copies with its peers if the hold's request says so (``hold.replicated`` resolves
        once every process of the exchange recorded what it received); ``writer`` may then
        be None (held only, not uploaded).

        The future resolves to DCP's metadata, or with ``reply`` (a function the process
        can unpickle) to what it makes of it there, so that only that crosses back to
        the trainer (docs/decisions/0007-staging-arena.md). With ``copy_failure`` (this
        rank's copy failed; ``staged`` is then empty), the save fails on every rank."""
        side = self._side
        assert side is not None
        slot = hold.slot if hold is not None else 0
        data = dumps_staged(staged.state_dict, self._arenas[slot], staged.placed)
        request = None
        if hold is not None:
            regions = tuple((r.segment, r.offset, r.nbytes) for r in staged.regions)
            request = dataclasses.replace(hold.request, regions=regions)
        save = SaveRequest(
            next(self._save_ids), slot, data, writer, planner, request, reply, copy_failure
        )
        future = side.save(save, hold)
        self._inflight = future
        return future

    # -- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the save in flight, stop the process, release the memory; idempotent."""
        if self._closed or os.getpid() != self._pid:
            self._closed = True
            return
        self._closed = True
        _open.discard(self)
        try:
            self.wait_idle()
            self.wait_retained()
        finally:
            self._stop_side()
            for arena in self._arenas:
                arena.close()
            self._store = None

    def __enter__(self) -> CheckpointProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        check_usable(self, self._closed, self._pid)

    def _meeting_place(self) -> tuple[Any, tuple[str, int] | None]:
        """With several ranks: rank 0's store for the checkpoint processes, its address on
        every rank (one broadcast), and every rank's connection to it (to watch the
        processes' meetings, :mod:`~s3ckpt.background.meeting`)."""
        if self.world == 1:
            return None, None
        store, box = None, [None]
        if self.rank == 0:
            host = os.environ.get("MASTER_ADDR") or default_store_host() or "127.0.0.1"
            store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            box = [(host, store.port)]
        source = 0 if self._group is None else dist.get_global_rank(self._group, 0)
        dist.broadcast_object_list(box, src=source, group=self._group)
        host, port = box[0]
        if store is None:
            timeout = timedelta(seconds=self._timeout_s)
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        return store, (host, port)

    def _start(self) -> None:
        meeting, watch = None, None
        if self._address is not None:
            host, port = self._address
            prefix = f"s3ckpt-checkpoint-process/{self._generation}"
            meeting = Meeting(host, port, prefix, self.rank, self.world, self._timeout_s)
            watch = MeetingWatch(self._store, prefix, self.rank)
        level = logging.getLogger("s3ckpt").getEffectiveLevel()
        hello = Hello(
            list(sys.path), level, meeting, self._config, process_niceness(self._nice),
            self._retention,
        )  # fmt: skip
        self._side = TrainerSide(hello, self._arenas, self.rank, watch)

    def _stop_side(self) -> None:
        side, self._side = self._side, None
        if side is not None:
            side.stop()


def check_usable(owner: object, closed: bool, pid: int) -> None:
    """Raise :class:`~s3ckpt.errors.CheckpointProcessError` if ``owner`` is closed, or
    belongs to another process (``pid``: a forked child has none of its threads)."""
    if closed:
        raise CheckpointProcessError(f"{owner!r} is closed")
    if os.getpid() != pid:
        raise CheckpointProcessError(
            f"{owner!r} belongs to process {pid}, not to this one ({os.getpid()})"
        )


def default_niceness() -> int:
    """The default ``nice``: 10 where this process may raise a priority it lowered (so
    a save it waits for runs at its own priority again), else 0: lowered for good, a
    save on a node whose cores stay busy would be starved, waits included."""
    return 10 if may_raise_priority() else 0


def may_raise_priority() -> bool:
    """Whether this process may set a thread of its own user back to its own nice
    value after raising it: ``CAP_SYS_NICE``, or an ``RLIMIT_NICE`` that reaches it."""
    try:
        status = Path("/proc/self/status").read_text()
        caps = int(next(line for line in status.splitlines() if line.startswith("CapEff:"))[7:], 16)
    except (OSError, StopIteration, ValueError):
        caps = 0
    if caps & (1 << _CAP_SYS_NICE):
        return True
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    lowest = 20 - soft if soft != resource.RLIM_INFINITY else -20
    return lowest <= os.getpriority(os.PRIO_PROCESS, 0)


_CAP_SYS_NICE = 23


def _niceness(nice: int | None) -> int:
    if nice is None:
        text = os.environ.get(NICE_VARIABLE) or str(default_niceness())
        try:
            nice = int(text)
        except ValueError:
            raise ConfigError(
                f"{NICE_VARIABLE} must be an int from 0 to 19, got {text!r}"
            ) from None
    if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
        raise ConfigError(f"nice must be an int from 0 to 19, got {nice!r}")
    return nice


_open: weakref.WeakSet[CheckpointProcess] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """The interpreter is exiting: let each save in flight finish, then stop the processes."""
    for process in list(_open):
        try:
            process.close()
        except Exception:
            log.exception("closing %r at exit failed", process)
