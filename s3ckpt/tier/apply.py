"""Applying a memory-tier step to the state: this rank's own copy, a copy arriving from
a peer, or (a job whose world size changed) every old rank's copy the node holds.

Each is a ``dcp.load`` on this rank alone (no collective) from a
:class:`~s3ckpt.dcp.state_reader.StateReader` over the copies, whose bytes are checked
against their CRC32Cs as they land (:mod:`s3ckpt.tier.copy_in`); when no committed S3
step could be loaded over damage, they were also checked whole before a byte is loaded
(:func:`verify_held`, :func:`verify_resharded`), and the check as they land then catches a
copy rewritten in between (a live run's slot, read by another job). Each returns what went wrong,
if anything, and whether that was a copy missing or not intact (so that an older step may
do) rather than a state the copy does not fit.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed.checkpoint as dcp

from s3ckpt.background.channel import loads_staged
from s3ckpt.background.held import HeldRecord, MappedCopy
from s3ckpt.background.replicate import ReceiveIntoModel
from s3ckpt.dcp.compat import CheckpointException, single_process, unwrap
from s3ckpt.dcp.state_reader import CopyIn, StateReader
from s3ckpt.tier.copies import LocalCopies, Version
from s3ckpt.tier.copy_in import CheckedCopyIn, ReceivingCopyIn

log = logging.getLogger("s3ckpt.tier")

Outcome = tuple["str | None", bool]
"""What went wrong applying a step (None: nothing), and whether a copy was missing or
damaged (an older step may do) rather than the state not fitting it (S3 then)."""


def verify_held(copies: LocalCopies, version: Version, received: bool = False) -> str | None:
    """This rank's copy of ``version`` checked whole against its CRC32Cs, before a byte
    of it is loaded (a copy received a moment ago was checked as it arrived: its state
    alone); what does not match or is missing, if anything."""
    mine = copies.own_copy(version)
    if mine is None:
        return f"rank {copies.rank}: no copy of step {version[0]}"
    return _verified(copies.rank, [(mine.folder, mine.held)], whole=not received)


def verify_resharded(rank: int, held: Mapping[int, tuple[Any, HeldRecord]]) -> str | None:
    """Every old rank's copy in ``held`` checked whole, before a byte is loaded."""
    return _verified(rank, [held[old_rank] for old_rank in sorted(held)])


def _verified(rank: int, held: list[tuple[Any, HeldRecord]], whole: bool = True) -> str | None:
    for folder, record in held:
        try:
            copy = MappedCopy(folder, record)
        except (OSError, ValueError) as exc:
            return f"rank {rank}: {exc}"
        try:
            damage = copy.verify() if whole else copy.state_problem()
        finally:
            copy.close()
        if damage is not None:
            return f"rank {rank}: {damage}"
    return None


def apply_held(
    state_dict: dict[str, Any],
    copies: LocalCopies,
    version: Version,
    planner: Any,
    received: bool = False,
) -> Outcome:
    """Load this rank's copy of ``version`` into ``state_dict``, checked as it lands
    (unless it was ``received`` a moment ago and checked as it arrived): what went wrong,
    if anything, and whether that was a copy missing or not intact (so an older step may
    do)."""
    slot = copies.own_copy(version)
    if slot is None:
        return f"rank {copies.rank}: no copy of step {version[0]}", True
    try:
        copy = MappedCopy(slot.folder, slot.held)
    except (OSError, ValueError) as exc:
        return f"rank {copies.rank}: {exc}", True
    try:
        damage = copy.state_problem()
        if damage is not None:
            return f"rank {copies.rank}: {damage}", True
        copy_in = CheckedCopyIn(copy, check=not received)
        return _load_checked(
            state_dict, _one_state(copy.state, copy.maps, copy_in), [copy_in], planner, copies.rank
        )
    finally:
        copy.close()


def apply_received(
    state_dict: dict[str, Any], rank: int, fetched: ReceiveIntoModel, planner: Any
) -> Outcome:
    """Load the copy ``fetched`` brings from a peer into ``state_dict`` as it arrives,
    checked as it lands: what went wrong, and whether the copy was not intact."""
    try:
        if fetched.problem is not None:
            return f"rank {rank}: {fetched.problem}", True
        copy_in = ReceivingCopyIn(fetched)
        reader_of = _one_state(fetched.state, fetched.maps, copy_in)
        return _load_checked(state_dict, reader_of, [copy_in], planner, rank)
    finally:
        fetched.finish()


def _one_state(state: bytes, maps: list[Any], copy_in: CopyIn) -> Callable[[], StateReader]:
    """What makes the reader over one staged state (unpickled when the load starts)."""
    return lambda: StateReader.of_state(loads_staged(state, maps), copy_in)


def _load_checked(
    state_dict: dict[str, Any],
    reader_of: Callable[[], StateReader],
    copy_ins: Sequence[CheckedCopyIn | ReceivingCopyIn],
    planner: Any,
    rank: int,
) -> Outcome:
    """Load from the reader ``reader_of`` makes, then ask each of ``copy_ins`` whether
    what landed was intact: the outcome (a failed load is the state not fitting; damage
    is a copy not intact)."""
    problem = _load(state_dict, reader_of, planner, rank)
    if problem is not None:
        return problem, False
    for copy_in in copy_ins:
        damage = copy_in.problem()
        if damage is not None:
            return f"rank {rank}: {damage}", True
    return None, False


def _load(
    state_dict: dict[str, Any], reader_of: Callable[[], StateReader], planner: Any, rank: int
) -> str | None:
    """``dcp.load`` into ``state_dict`` from the reader ``reader_of`` makes, on this rank
    alone; what went wrong, if anything."""
    try:
        reader = reader_of()
        with single_process():
            dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=True)
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        error = unwrap(exc)
        log.debug("applying the held copy failed", exc_info=error)
        return f"rank {rank}: {type(error).__name__}: {error}"
    return None


def apply_resharded(
    state_dict: dict[str, Any],
    rank: int,
    held: Mapping[int, tuple[Any, HeldRecord]],
    planner: Any,
) -> Outcome:
    """Load the step every old rank's copy in ``held`` (old rank -> its folder and
    descriptor, all on this node) makes up into ``state_dict``, resharded to this job's
    layout as a load from S3 would be; each copy is checked where the load read from it."""
    with contextlib.ExitStack() as stack:
        opened: list[tuple[MappedCopy, CheckedCopyIn]] = []
        for old_rank in sorted(held):
            folder, record = held[old_rank]
            try:
                copy = MappedCopy(folder, record)
            except (OSError, ValueError) as exc:
                return f"rank {rank}: {exc}", True
            stack.callback(copy.close)
            damage = copy.state_problem()
            if damage is not None:
                return f"rank {rank}: {damage}", True
            opened.append((copy, CheckedCopyIn(copy, whole=False)))

        def reader() -> StateReader:
            return StateReader([(loads_staged(c.state, c.maps), i) for c, i in opened])

        return _load_checked(state_dict, reader, [i for _, i in opened], planner, rank)
