"""``TrainerSide``: the trainer's side of one started checkpoint process (runs in the
trainer; :mod:`s3ckpt.background.process_side` is the other end).

:class:`~s3ckpt.background.process.CheckpointProcess` keeps one at a time and replaces it
when it dies; this is what talks to it: the child started (a fresh interpreter running
:mod:`s3ckpt.background.process_side`), the socket to it, the thread that reads its
answers, and each save's futures (its outcome, and when its copy was held and replicated). A
child that dies fails every save in flight with
:class:`~s3ckpt.errors.CheckpointProcessError`, after aborting the uploads it left open.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from s3ckpt.background.arena import StagingArena
from s3ckpt.background.channel import Channel, ChannelClosed
from s3ckpt.background.meeting import MeetingWatch
from s3ckpt.background.priority import SavePriority
from s3ckpt.background.protocol import (
    CopyHeld,
    Failed,
    Hello,
    HoldRequest,
    Ready,
    Replicated,
    Retained,
    Saved,
    SaveRequest,
    Segments,
    Stop,
    ToTrainer,
    unknown,
)
from s3ckpt.errors import CheckpointProcessError, S3CkptError

log = logging.getLogger("s3ckpt.background")

STOP_TIMEOUT_S = 1.0  # a ready process exits at once when asked; killed after this


@dataclass(eq=False)
class TierHold:
    """A save's copy kept as a memory-tier checkpoint, as the trainer follows it: staged in
    arena ``slot`` (one of the process's memory slots), recorded by the process as
    ``request`` says; ``held`` resolves once it is, ``replicated`` once the request's
    exchange with peers is done (if it has one); both fail with the save."""

    slot: int
    request: HoldRequest
    held: Future[None] = field(default_factory=Future)
    replicated: Future[None] = field(default_factory=Future)
    nbytes: int = 0  # the copy's tensor bytes, once staged


class _Pending(NamedTuple):
    """A save sent and not answered yet: its future, its writer (to abort what a dead
    process left open), and its hold."""

    future: Future[Any]
    writer: Any
    hold: TierHold | None


class TrainerSide:
    """One started checkpoint process: its pipe, its reader thread, its saves' futures."""

    def __init__(
        self,
        hello: Hello,
        arenas: list[StagingArena],
        rank: int,
        meeting: MeetingWatch | None = None,
    ) -> None:
        self._arenas = arenas
        self._rank = rank
        self._meeting = meeting
        self._stopped_because: str | None = None  # another rank's process died meeting
        self._sent_segments = [0] * len(arenas)
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}  # by save id
        self._retains = hello.retention is not None
        self._retaining: dict[int, Future[None]] = {}  # retentions after uploads, by save id
        self.failed = False
        self.gone = False
        self._start_error: BaseException | None = None
        self._ready = threading.Event()  # set once it answered ready, or is gone
        self._closing = False  # killed by stop() before it was ready
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-m", "s3ckpt.background.process_side", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=process_environment(),
            )
        finally:
            theirs.close()
        self.pid = self._popen.pid
        self._priority = SavePriority(self.pid, hello.nice)
        self._channel = Channel(ours)
        self._channel.send(hello)
        self._reader = threading.Thread(
            target=self._read, name=f"s3ckpt-checkpoint-process-{self.pid}", daemon=True
        )
        self._reader.start()
        if meeting is not None:
            meeting.watch(self._stop_meeting)

    @property
    def ready(self) -> bool:
        """Whether the process answered ready (its imports, client and meeting done)."""
        return self._ready.is_set() and not self.gone

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the process is ready; :class:`~s3ckpt.errors.CheckpointProcessError`
        if it died first or could not start, or if ``timeout`` seconds pass first."""
        if not self._ready.wait(timeout):
            raise CheckpointProcessError(
                f"the checkpoint process of rank {self._rank} (pid {self.pid}) was not "
                f"ready after {timeout:g} s"
            )
        if self.gone:
            self._reader.join()  # its pending saves failed, its exit status is known
            raise self._died("while starting")

    def hurry(self) -> None:
        """Someone waits for this process's save: run it at the trainer's priority, where
        the trainer may raise a priority it lowered (privileged, or ``RLIMIT_NICE``);
        else nothing changes. :meth:`relax` undoes it."""
        if self.ready:
            self._priority.hurry()

    def relax(self) -> None:
        """Back to the niceness the process saves at, after :meth:`hurry` (unless other
        work fills the node's cores: :mod:`s3ckpt.background.priority`)."""
        self._priority.hurry(False)

    def _watch_contention(self) -> None:
        """Sample the demand for cores while saves are in flight."""
        with self._lock:
            active = bool(self._pending) and not self.gone
        self._priority.watch(active)

    def healthy(self, world: int) -> bool:
        """Alive, and (with several ranks) its last save did not fail."""
        return not self.gone and not (world > 1 and self.failed)

    def save(self, request: SaveRequest, hold: TierHold | None = None) -> Future[Any]:
        """Send ``request``; its save's future (``hold``: the request's hold, whose futures
        the process's answers resolve)."""
        future = self._register(request, hold)
        self._watch_contention()
        if not future.done():
            # a closed channel: the reader thread fails the future with the exit status
            with contextlib.suppress(ChannelClosed):
                self._send_segments(request.slot)
                self._channel.send(request)
        return future

    def _register(self, request: SaveRequest, hold: TierHold | None) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self.gone:
                _fail(self._died("before the save was sent"), _Pending(future, None, hold))
                return future
            self._pending[request.save_id] = _Pending(future, request.writer, hold)
        return future

    def wait_retained(self) -> None:
        """Until the retentions after the uploads so far are done (or the process is gone)."""
        with self._lock:
            retaining = list(self._retaining.values())
        for retained in retaining:
            retained.result()

    def _send_segments(self, slot: int) -> None:
        segments = self._arenas[slot].segments[self._sent_segments[slot] :]
        if segments:
            sizes = tuple(segment.size for segment in segments)
            self._channel.send(Segments(slot, sizes), [segment.fd for segment in segments])
            self._sent_segments[slot] += len(segments)

    def _read(self) -> None:
        try:
            while True:
                message, _ = self._channel.receive()
                self._settle(message)
        except (ChannelClosed, ConnectionError):  # a reset: it died with our data unread
            pass
        except Exception:  # never leave a save's future unresolved
            log.exception("reading from the checkpoint process %d failed", self.pid)
        with self._lock:
            self.gone = True
            pending, self._pending = self._pending, {}
        self._ready.set()
        with self._lock:
            retaining, self._retaining = self._retaining, {}
        if retaining:
            log.warning("the checkpoint process %d ended before its retention did", self.pid)
        for retained in retaining.values():
            retained.set_result(None)
        self._priority.stop()
        meeting = self._meeting
        before_meeting = meeting is not None and not meeting.is_met
        if before_meeting and self._stopped_because is None:
            meeting.abandon("was closed" if self._closing else self._exit_status())
        if meeting is not None:
            meeting.end()
        if pending:
            error = self._died("while meeting its peers" if before_meeting else "during the save")
            for save in pending.values():
                if save.writer is not None:
                    _abort_open_uploads(save.writer, self._rank, error)
                _fail(error, save)

    def _settle(self, message: ToTrainer) -> None:
        match message:
            case Ready():
                if self._meeting is not None:
                    self._meeting.met()
                self._ready.set()
            case CopyHeld(save_id) | Replicated(save_id):
                with self._lock:
                    pending = self._pending.get(save_id)
                hold = None if pending is None else pending.hold
                if hold is not None:
                    reached = hold.replicated if isinstance(message, Replicated) else hold.held
                    reached.set_result(None)
            case Saved(save_id, metadata):
                save = self._finish(save_id)
                if save is not None:
                    if self._retains and save.writer is not None:
                        with self._lock:  # before the save is seen done
                            self._retaining[save_id] = Future()
                    save.future.set_result(metadata)
            case Retained(save_id):
                with self._lock:
                    retained = self._retaining.pop(save_id, None)
                if retained is not None:
                    retained.set_result(None)
            case Failed(save_id, error):
                self._failed(save_id, error)
            case _:
                raise unknown(message, f"the checkpoint process {self.pid}")

    def _finish(self, save_id: int | None) -> _Pending | None:
        """Save ``save_id``, no longer pending (None, if none)."""
        with self._lock:
            pending = self._pending.pop(save_id, None) if save_id is not None else None
        self._watch_contention()
        return pending

    def _failed(self, save_id: int | None, error: BaseException) -> None:
        """Save ``save_id`` failed, or (None) the process could not start."""
        save = self._finish(save_id)
        self.failed = True
        if not isinstance(error, S3CkptError):
            wrapped = CheckpointProcessError(
                f"the checkpoint process of rank {self._rank} failed: "
                f"{type(error).__name__}: {error}"
            )
            wrapped.__cause__ = error
            error = wrapped
        if save is not None:
            _fail(error, save)
        else:  # it could not start: the next save's future gets the reason
            self._start_error = error
            log.error("the checkpoint process %d could not start: %s", self.pid, error)

    def _stop_meeting(self, reason: str) -> None:
        """Another rank's process died before the group was formed: this one, still
        meeting, would wait for it until the collective timeout."""
        self._stopped_because = reason
        log.warning("stopping the checkpoint process %d: %s", self.pid, reason)
        with contextlib.suppress(OSError):
            self._popen.kill()

    def _exit_status(self) -> str:
        try:
            code = self._popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        if self._start_error is not None:
            return f"could not start ({self._start_error})"
        return (
            "is unresponsive" if code is None
            else f"was killed by signal {-code}" if code < 0
            else f"exited with status {code}"
        )  # fmt: skip

    def _died(self, when: str) -> CheckpointProcessError:
        how = self._exit_status()
        if self._stopped_because is not None:
            how = f"was stopped ({self._stopped_because})"
        elif self._start_error is not None:
            when = ""
        return CheckpointProcessError(
            f"the checkpoint process of rank {self._rank} (pid {self.pid}) {how}"
            f"{' ' + when if when else ''}; "
            "the save is not committed, and the next save starts a new process"
        )

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """End the process, with no save in flight: one still starting is killed at once
        (nothing of it is lost; its start-up could take seconds more), a ready one is
        asked to exit (at the trainer's priority where it may be raised) and killed if it
        has not within ``timeout`` seconds."""
        if self._ready.is_set():
            self.hurry()
            with contextlib.suppress(ChannelClosed, OSError):
                self._channel.send(Stop())
            try:
                self._popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("the checkpoint process %d did not stop; killing it", self.pid)
        if self._popen.poll() is None:
            self._closing = True
            self._popen.kill()
            self._popen.wait()
        self._channel.close()
        self._reader.join(timeout=timeout)


def _fail(error: BaseException, save: _Pending) -> None:
    """Fail a save's future, and its hold's futures not resolved yet."""
    if save.hold is not None:
        for waiting in (save.hold.held, save.hold.replicated):
            if not waiting.done():
                waiting.set_exception(error)
    save.future.set_exception(error)


def _abort_open_uploads(writer: Any, rank: int, error: CheckpointProcessError) -> None:
    """Abort the multipart uploads a dead checkpoint process left open for ``writer``'s
    checkpoint (this rank's data objects), before its save's failure is reported; what
    remains (objects already written, uncommitted) is ``s3ckpt gc``'s, as after any
    killed save. Noted on ``error``."""
    location, config = getattr(writer, "location", None), getattr(writer, "config", None)
    if location is None or config is None:
        return
    from s3ckpt.s3.loop import io_loop
    from s3ckpt.s3.store import ObjectStore
    from s3ckpt.transfer.aborts import abort_rank_uploads

    store = ObjectStore(config, location.bucket)
    try:
        aborted = io_loop().run(abort_rank_uploads(store, location.prefix + "/", rank))
    except Exception as exc:  # a store without ListMultipartUploads, say: gc's job then
        error.add_note(f"its open uploads under {location} were not aborted ({exc}): s3ckpt gc")
        log.warning("could not abort the uploads the checkpoint process left: %s", exc)
        return
    if aborted:
        error.add_note(f"{aborted} upload(s) it left open under {location} were aborted")


def process_environment() -> dict[str, str]:
    """The trainer's environment, with s3ckpt importable however the trainer found it."""
    package_root = str(Path(__file__).resolve().parents[2])
    paths = [package_root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def process_niceness(by: int) -> int | None:
    """The niceness a checkpoint process saves at: ``by`` more than this process's (at
    most 19); None when ``by`` is 0 (it stays at the trainer's)."""
    if by <= 0:
        return None
    return min(19, os.getpriority(os.PRIO_PROCESS, 0) + by)
