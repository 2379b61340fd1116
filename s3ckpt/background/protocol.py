"""The messages between a trainer and its checkpoint process, in both directions.

Each rank's trainer (:class:`~s3ckpt.background.trainer_side.TrainerSide`) and the
checkpoint process it started (:mod:`s3ckpt.background.process_side`) talk over one
:class:`~s3ckpt.background.channel.Channel`: every message is one of the classes below,
pickled, and each side dispatches on its type; a message of any other type is an error
where it is received (:class:`~s3ckpt.errors.CheckpointProcessError`), never dropped.

The lifecycle, in the order the messages travel:

1. **Start.** The trainer sends :class:`Hello` first. The process answers
   :class:`Ready` once it has imported what a save runs, made the S3 client, met its
   peers and lowered its priority; or :class:`Failed` (with no save id) and exits.
2. **Segments.** Before a save whose arena has grown, the trainer sends
   :class:`Segments`: the sizes of the new segments of one arena, whose descriptors ride
   with the message (``SCM_RIGHTS``), in the same order. The process maps them, once each.
3. **Save.** The trainer sends :class:`SaveRequest`. With a hold, the process answers
   :class:`CopyHeld` once the copy is recorded in its memory-tier slot, then
   :class:`Replicated` once its copies were exchanged with its peers (when the hold says
   so); then :class:`Saved` (the upload's outcome) or :class:`Failed` (the error), one of
   the two for every request. With several ranks a process exits after a failed save.
   After a :class:`Saved` of an upload, a process whose :class:`Hello` carried a retention
   applies it, then answers :class:`Retained`.
4. **Stop.** The trainer sends :class:`Stop` (or closes the socket): the process exits.

Trainer to process: :class:`Hello`, :class:`Segments`, :class:`SaveRequest`,
:class:`Stop`. Process to trainer: :class:`Ready`, :class:`CopyHeld`, :class:`Replicated`,
:class:`Saved`, :class:`Retained`, :class:`Failed`. :class:`Meeting` travels inside :class:`Hello`,
:class:`HoldRequest` and :class:`CopyFailure` inside :class:`SaveRequest`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from s3ckpt.errors import CheckpointProcessError

if TYPE_CHECKING:
    from s3ckpt.background.replicate import ReplicaExchange

# -- the trainer's messages ----------------------------------------------------------------


@dataclass(frozen=True)
class Meeting:
    """Where the checkpoint processes of several ranks form their group: rank 0's
    store (``host``, ``port``) under ``prefix`` (one per generation of processes), this
    process's ``rank`` of ``world``, and the group's collective timeout."""

    host: str
    port: int
    prefix: str
    rank: int
    world: int
    timeout_s: float


@dataclass(frozen=True)
class Hello:
    """The first message: what the process needs before its first save."""

    sys_path: list[str]  # the trainer's, ahead of the process's own
    log_level: int  # of the ``s3ckpt`` loggers
    meeting: Meeting | None  # with several ranks
    config: Any = None  # the S3Config of the saves to come: its client is made at start
    nice: int | None = None  # the niceness the process saves at, once ready
    # applied after each commit (rank 0's: a catalog.run_retention.RunRetention)
    retention: Any = None


@dataclass(frozen=True)
class Segments:
    """New staging segments of arena ``slot``: one size per descriptor that rides with
    this message, in order (they follow the segments sent before)."""

    slot: int
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class HoldRequest:
    """Hold a save's copy: record it in its memory-tier slot (``folder``) as ``step``'s
    checkpoint (a :class:`~s3ckpt.background.held.HeldRecord` last), then exchange copies
    with peers as ``replicate`` says."""

    folder: str
    step: int
    rank: int
    world: int
    run: str
    regions: tuple[tuple[int, int, int], ...] = ()  # segment, offset, nbytes of each storage
    # then sent to (and received from) peers on other nodes
    replicate: ReplicaExchange | None = None
    lineage: str = ""  # the saves this one continues (held.HeldRecord.lineage)


@dataclass(frozen=True)
class CopyFailure:
    """This rank could not copy its state to host memory: ``reason`` names the save, the
    rank and the error. Its request still goes to its process, which takes part in the
    save's first collective (:func:`~s3ckpt.background.ranks.raise_copy_failures`), so
    every rank's save fails with ``reason`` and none waits for this one."""

    reason: str


@dataclass(frozen=True)
class SaveRequest:
    """Save the copy staged in arena ``slot``: the one request of a save, made once by
    :meth:`~s3ckpt.background.process.CheckpointProcess.submit`, sent as it is, run as
    it is by the process.

    ``data`` is the state pickled with its arena tensors by reference
    (:func:`~s3ckpt.background.channel.dumps_staged`); ``writer`` uploads it (None: held
    only); ``planner`` is the trainer's (None: the process's own, one per slot); ``hold``
    records the copy first (:class:`CopyHeld`, :class:`Replicated`); ``reply``, run in the
    process on DCP's metadata, makes what :class:`Saved` carries instead of it;
    ``copy_failure``: this rank's copy failed, the save fails on every rank."""

    save_id: int
    slot: int
    data: bytes
    writer: Any
    planner: Any
    hold: HoldRequest | None
    reply: Callable[[Any], Any] | None = None
    copy_failure: CopyFailure | None = None


@dataclass(frozen=True)
class Stop:
    """Exit; sent with no save in flight."""


# -- the process's answers -----------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """Answers :class:`Hello`: the process (``pid``) is ready to save."""

    pid: int


@dataclass(frozen=True)
class CopyHeld:
    """Save ``save_id``'s copy is recorded in its memory-tier slot."""

    save_id: int


@dataclass(frozen=True)
class Replicated:
    """Save ``save_id``'s copies were exchanged with the peers its hold names."""

    save_id: int


@dataclass(frozen=True)
class Saved:
    """Save ``save_id`` completed: DCP's metadata (the request's ``reply`` of it, or None
    without a writer)."""

    save_id: int
    metadata: Any


@dataclass(frozen=True)
class Retained:
    """The retention after save ``save_id``'s commit is done (its errors were logged)."""

    save_id: int


@dataclass(frozen=True)
class Failed:
    """Save ``save_id`` failed, or (``save_id`` None) the process could not start:
    ``error`` is the s3ckpt error inside the failure, in a form that survives pickling."""

    save_id: int | None
    error: BaseException


ToProcess = Hello | Segments | SaveRequest | Stop
ToTrainer = Ready | CopyHeld | Replicated | Saved | Retained | Failed


def unknown(message: object, sender: str) -> CheckpointProcessError:
    """The error for a message that is none of ``sender``'s (a side's ``match`` falls
    through to it): the two sides disagree on the protocol."""
    return CheckpointProcessError(
        f"unknown message from {sender}: {type(message).__qualname__} {message!r:.200}"
    )
