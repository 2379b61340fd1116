"""Restoring from the memory tier: the newest step the whole job holds intact, or none.

``CheckpointManager.load_latest`` with a memory tier asks here first:

1. **Agree on a step.** Each rank lists the complete copies it holds, its own and the
   replicas it keeps for peers (their descriptors); one all-gather gives every rank the
   same view. The newest step whose every rank's state is held somewhere, at least the
   newest committed S3 step, is the candidate (S3 wins when it is newer). A step is its
   number and its lineage (:data:`~s3ckpt.tier.copies.Version`): copies of one step
   number saved by two timelines (a run rolled back, with some copies of the abandoned
   one left where no rank of the rollback ran) are two candidates, never one.
2. **Fetch what is missing.** A rank whose own copy is gone (its node was replaced)
   counts as holding the step when a peer on another node holds its replica: the peers
   send such replicas to the ranks missing them, checked as they arrive. With a committed
   S3 step to fall back on, a receiving rank with nothing to send loads the copy as it
   arrives, each large tensor straight from the socket into the model
   (:class:`~s3ckpt.tier.copy_in.ReceivingCopyIn`): no tmpfs pages to reserve and no
   second copy, half the time of a peer restore here. It then holds no copy of that step
   until its next save (the peer's replica still does). Otherwise the receiver records
   the copy as its own first, and loads it from there.
3. **Apply, checked.** ``dcp.load`` from the copy
   (:class:`~s3ckpt.dcp.state_reader.StateReader`, :mod:`s3ckpt.tier.apply`), rank by
   rank with no collective: each rank's copy holds exactly the shards it saved, so a
   restart with the same world size and sharding finds every piece it needs; DCP calls
   the ``Stateful`` objects' ``load_state_dict`` as for any load. Every region is checked against its CRC32C, as
   every S3 read is: as it is read into the model (:mod:`s3ckpt.tier.copy_in`), and, when
   no committed S3 step could be loaded over a damaged one, also before a byte is loaded
   (a copy rewritten in between, a live run's slot read by another job, is still caught
   as it lands, and the job walks back). One
   all-gather of the outcomes: if any rank's copy is missing or damaged, the job walks
   back to the next step every rank holds, which loads over it; a rank that could not
   apply (its state no longer matches the copy's) sends every rank on to S3, so no model
   is ever left assembled from two steps.

**Another world size.** A job restarted with more or fewer ranks holds no copy of its
own, but the old job's copies are still in the nodes' shared memory: every old rank's
copy of a step, together, is that step's checkpoint (each staged with the write items DCP
made for its shards, :class:`~s3ckpt.background.shards.StagedShards`). Each rank reports
the old steps whose every rank's copy its node holds (its own copies or replicas); a step
every node holds whole is a candidate beside the job's own steps, and each rank loads its
new shards from the node's copies through DCP's resharding load, as from S3, checking
each copy's regions it read from (:func:`~s3ckpt.tier.apply.apply_resharded`). That
covers a single-node job restarted on fewer or more devices, and a job whose nodes each
keep every other node's replicas (two nodes, one replica); where a node lacks some old
rank's copy, the step comes from S3. The new layout frees the old one's copies at its
first save (:meth:`~s3ckpt.tier.copies.LocalCopies.tidy`).

The step is chosen once for every rank and never mixed: every rank applies the same step,
or every rank falls back to S3 (which loads over whatever was applied).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from s3ckpt.background.replicate import ReceiveIntoModel, ReplicaExchange
from s3ckpt.dcp.compat import unwrap
from s3ckpt.tier.apply import (
    Outcome,
    apply_held,
    apply_received,
    apply_resharded,
    verify_held,
    verify_resharded,
)
from s3ckpt.tier.copies import Holdings, LocalCopies, OldStep, Version

log = logging.getLogger("s3ckpt.tier")

Gather = Callable[[Any], list[Any]]
"""One all-gather of a picklable value across the ranks that restore together."""


@dataclass(frozen=True)
class Restored:
    """Where a ``load_latest`` found its step, and what it cost."""

    step: int
    tier: str  # "memory" or "s3"
    select_s: float  # choosing the step (and fetching copies from peers)
    load_s: float  # applying it, checked (and walking back to older steps)


def restore_from_memory(
    state_dict: dict[str, Any],
    copies: LocalCopies,
    gather: Gather,
    s3_latest: int | None,
    fetch: Callable[[ReplicaExchange], None] | None = None,
    planner: Any = None,
    receive: Callable[[int], ReceiveIntoModel] | None = None,
) -> Restored | None:
    """Load the newest step the job can rebuild from memory intact (not older than
    ``s3_latest``) into ``state_dict``; None when there is none (then load from S3).
    Every rank calls it. A rank whose own copy is missing receives it from a peer that
    holds its replica, through ``fetch`` (an exchange among the ranks), or, given
    ``receive`` and an S3 step to fall back on, straight into ``state_dict`` as it
    arrives (``receive(peer)`` starts that rank's part of the same exchange). A step
    saved with another world size is resharded from the node's copies when every node
    of the job holds every old rank's copy of it."""
    started = time.perf_counter()
    others = copies.other_worlds()
    reports: list[tuple[Holdings, list[OldStep]]] = gather((copies.holdings(), sorted(others)))
    every = [holdings for holdings, _ in reports]
    common = set.intersection(*(set(theirs) for _, theirs in reports))
    # With a committed S3 step to fall back to, each rank checks its copy as it loads it
    # (one pass, copy_in.py): a damaged copy's bytes may land in the model, and the whole
    # job then loads an older step (or S3) over them. With none, every rank's copies are
    # checked, and the verdicts gathered, before any rank loads a byte: a copy found
    # damaged leaves every rank's state untouched (and is checked as it lands again, for
    # a copy rewritten since, by the live run whose slot another job reads).
    check_first = s3_latest is None
    for version, world in _candidates(every, common, copies.world, s3_latest):
        step = version[0]
        if world == copies.world:
            into_model = receive if not check_first else None
            fetched = _fetch_step(
                state_dict, copies, every, version, gather, fetch, into_model, planner
            )
            if fetched is _NOT_FETCHED:
                continue
            chosen = time.perf_counter()
            received = copies.rank in _fetch_plan(every, version)
            if check_first and not _all_intact(
                gather(verify_held(copies, version, received)), step
            ):
                continue
            outcome = (
                apply_held(state_dict, copies, version, planner, received)
                if fetched is None
                else fetched
            )
        else:
            chosen = time.perf_counter()
            log.info("resharding step %d saved by %d ranks from this node's copies", step, world)
            held = others[(world, *version)]
            if check_first and not _all_intact(gather(verify_resharded(copies.rank, held)), step):
                continue
            outcome = apply_resharded(state_dict, copies.rank, held, planner)
        outcomes = gather(outcome)
        problems = [p for p, _ in outcomes if p]
        if any(d for _, d in outcomes):
            log.warning(
                "step %d in memory is not intact on every rank (%s); trying an older one",
                step, "; ".join(problems),
            )  # fmt: skip
            continue
        if problems:
            log.warning(
                "step %d could not be loaded from memory on every rank (%s); loading from S3",
                step, "; ".join(problems),
            )  # fmt: skip
            return None
        return Restored(step, "memory", chosen - started, time.perf_counter() - chosen)
    return None


_NOT_FETCHED: Outcome = ("not fetched", True)


def _all_intact(verdicts: list[str | None], step: int) -> bool:
    """Whether every rank found its copies of ``step`` intact (the gathered verdicts)."""
    problems = [v for v in verdicts if v]
    if problems:
        log.warning(
            "step %d in memory is not intact on every rank (%s); trying an older one",
            step, "; ".join(problems),
        )  # fmt: skip
    return not problems


def _fetch_step(
    state_dict: dict[str, Any],
    copies: LocalCopies,
    every: list[Holdings],
    version: Version,
    gather: Gather,
    fetch: Callable[[ReplicaExchange], None] | None,
    receive: Callable[[int], ReceiveIntoModel] | None,
    planner: Any,
) -> Outcome | None:
    """Bring the copies of ``version`` that ranks are missing from their peers (every rank
    takes part): this rank's outcome when it loaded its copy as it arrived, None when its
    copy is now held here, :data:`_NOT_FETCHED` when any rank's fetch failed. Given
    ``receive``, the ranks that send nothing receive their copies into the model."""
    plan = _fetch_plan(every, version)
    if not plan:
        return None
    in_place = _received_in_place(plan, receive is not None)
    outcome = None
    problem = None
    if copies.rank in in_place:
        assert receive is not None
        outcome = apply_received(state_dict, copies.rank, receive(plan[copies.rank]), planner)
    else:
        problem = _fetch(copies, plan, version, fetch, skip=in_place)
    if any(gather(problem)):
        log.warning("step %d could not be fetched from the peers holding it", version[0])
        return _NOT_FETCHED
    return outcome


def _candidates(
    every: list[Holdings], resharded: set[OldStep], world: int, s3_latest: int | None
) -> list[tuple[Version, int]]:
    """The ``(version, world)`` the job may restore from memory, newest step first: the
    versions of its own world size it can rebuild, and those of another that every node
    can reshard (at an equal step, its own world's first; then the newest copy's)."""
    found = [(version, world) for version in _rebuildable(every, s3_latest)]
    found += [
        ((step, lineage), old)
        for old, step, lineage in resharded
        if s3_latest is None or step >= s3_latest
    ]
    return sorted(found, key=lambda c: (c[0][0], c[1] == world), reverse=True)


def _rebuildable(every: list[Holdings], s3_latest: int | None) -> list[Version]:
    """Versions every rank's state can be had for from memory (its own copy, or a peer's
    replica of it), at least ``s3_latest``, newest step first."""
    versions = set()
    for holdings in every:
        versions.update(holdings.own)
    return sorted(
        (
            version for version in versions
            if (s3_latest is None or version[0] >= s3_latest)
            and all(version in every[rank].own or _holder(every, rank, version) is not None
                    for rank in range(len(every)))
        ),
        reverse=True,
    )  # fmt: skip


def _holder(every: list[Holdings], rank: int, version: Version) -> int | None:
    """The lowest rank holding a replica of ``rank``'s copy of ``version``."""
    for holder, holdings in enumerate(every):
        if version in holdings.replicas.get(rank, []):
            return holder
    return None


def _fetch_plan(every: list[Holdings], version: Version) -> dict[int, int]:
    """For ``version``: each rank without its own copy, and the peer it receives it from."""
    plan = {}
    for rank, holdings in enumerate(every):
        if version not in holdings.own:
            holder = _holder(every, rank, version)
            assert holder is not None
            plan[rank] = holder
    return plan


def _received_in_place(plan: dict[int, int], allowed: bool) -> set[int]:
    """The ranks of ``plan`` that receive their copy straight into the model: all that
    send nothing in the same exchange, when ``allowed`` (the same on every rank)."""
    if not allowed:
        return set()
    senders = set(plan.values())
    return {rank for rank in plan if rank not in senders}


def _fetch(
    copies: LocalCopies,
    plan: dict[int, int],
    version: Version,
    fetch: Callable[[ReplicaExchange], None] | None,
    skip: Collection[int] = (),
) -> str | None:
    """This rank's part of fetching ``plan``: send the replicas it holds, receive its own
    copy into an emptied slot (unless it is in ``skip``: it receives into the model,
    :func:`~s3ckpt.tier.apply.apply_received`). What went wrong, if anything."""
    sends = []
    for rank, holder in plan.items():
        if holder == copies.rank:
            replica = copies.replica_of(rank, version)
            assert replica is not None
            sends.append((rank, str(replica.folder)))
    receives = ()
    if copies.rank in plan and copies.rank not in skip:
        slot = copies.next_slot()
        copies.invalidate(slot)
        receives = ((plan[copies.rank], str(copies.slots[slot])),)
    if fetch is None:
        return "no checkpoint process to fetch copies with"
    try:
        fetch(ReplicaExchange(tuple(sends), receives))
    except Exception as exc:
        error = unwrap(exc)
        return f"rank {copies.rank}: {type(error).__name__}: {error}"
    if receives:
        log.info("received this rank's copy of step %d from rank %d", version[0], plan[copies.rank])
    return None
