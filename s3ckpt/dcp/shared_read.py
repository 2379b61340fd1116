"""A multi-rank load that reads each stored byte range once across its process group.

Given ``S3StorageReader(process_group=...)``, the ranks of a load tell each other, in one
small all-gather, which stored ranges their read items need; :func:`~s3ckpt.transfer.shares.
plan_shares` gives every range that several ranks need to one of them. Each rank then
fetches what only it needs and the shared ranges it was given, with the usual parallel
ranged GETs, CRC32C checks and re-reads of damage, and passes each shared range to the
ranks that need it with point-to-point sends over the group (gloo carries CPU tensors).
Receivers verify the bytes against their block CRC32Cs before the planner sees them.

Bytes land where an unshared load would put them (the destination tensor, or the scratch
buffer the item has anyway), so sharing adds no host memory. A range needed by one rank
only costs no traffic between ranks; a load with nothing replicated (pure FSDP) makes
the one all-gather and then reads as it would alone.

Failures never leave a rank waiting: a rank that cannot plan or fetch its share says so
in the next collective, and every rank then raises that rank's error (its own first).
A compressed item is fetched and decoded (and so verified) by its owner, which passes on
the decoded bytes: the store is read once, and the receivers check those bytes against
the same block CRC32Cs (which are of the raw bytes) without decoding anything.
Destinations in device memory get a host buffer for the load here (``stage=False``), the
memory that gloo sends from and receives into.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from s3ckpt.dcp.compat import LoadPlan, LoadPlanner
from s3ckpt.dcp.process_group import GroupBroadcast, portable
from s3ckpt.dcp.restore import PendingRead, hand_to_planner
from s3ckpt.format.checksums import verify_blocks
from s3ckpt.transfer.shares import SharePlan, Span, plan_shares

if TYPE_CHECKING:
    from s3ckpt.dcp.reader import S3StorageReader


class SharedRead:
    """One ``read_data`` of a rank whose reader was given a process group."""

    def __init__(self, reader: S3StorageReader, group: GroupBroadcast) -> None:
        self.reader = reader
        self.group = group
        self.rank = group.rank

    def run(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        pending: list[PendingRead] = []
        try:
            self.reader._locate(plan)
            pending = [
                self.reader._prepare(request, planner, stage=False) for request in plan.items
            ]
            primaries = _primaries(pending)
            outcome: Any = ("needs", sorted(primaries))
        except Exception as exc:
            outcome = ("failed", portable(exc))
            failure: Exception | None = exc
        else:
            failure = None
        gathered = self.group.all_gather(outcome)
        _raise_first(failure, [o[1] for o in gathered if o[0] == "failed"])
        shares = plan_shares([o[1] for o in gathered])
        if not shares.shared:
            self.reader._fetch(pending, planner)
            return
        self._share(shares, pending, primaries, planner)

    def _share(
        self,
        shares: SharePlan,
        pending: list[PendingRead],
        primaries: dict[Span, PendingRead],
        planner: LoadPlanner,
    ) -> None:
        receives = shares.receives(self.rank)
        received = {id(primaries[span]) for span, _ in receives}
        owned = frozenset(id(primaries[span]) for span in shares.fetched_by(self.rank))
        failure: Exception | None = None
        kept: dict[int, PendingRead] = {}
        try:
            here = [p for p in pending if id(p) not in received]
            kept = self.reader._fetch(here, planner, keep=owned)
        except Exception as exc:
            failure = exc
        statuses = self.group.all_gather(None if failure is None else portable(failure))
        _raise_first(failure, [s for s in statuses if s is not None])
        sends = [
            (kept[id(primaries[span])].raw, peer, shares.tags[span])
            for span, peer in shares.sends(self.rank)
        ]
        for span, _ in receives:
            primaries[span].allocate_scratch()  # a compressed item decodes nothing here
        arriving = [(primaries[span].raw, owner, shares.tags[span]) for span, owner in receives]
        self.group.exchange(sends, arriving)
        trust = self.reader.trust_pickles
        for item in kept.values():
            hand_to_planner(item, planner, trust_pickles=trust)
        for span, owner in receives:
            item = primaries[span]
            verify_blocks(
                item.raw_view,
                item.stored.crc32c,
                block_size=item.stored.block_size,
                first_block=item.span[0] // item.stored.block_size,
                what=f"{item.what} (passed on by rank {owner})",
            )
            hand_to_planner(item, planner, trust_pickles=trust)


def _primaries(pending: list[PendingRead]) -> dict[Span, PendingRead]:
    """The stored range of every item, each range's first item; the others (the same range
    read twice by one rank, rare) are fetched as they are."""
    primaries: dict[Span, PendingRead] = {}
    for item in pending:
        if item.stored_span[1] == item.stored_span[0]:
            continue
        start = item.stored.offset + item.stored_span[0]
        span = (item.stored.key, start, start + item.stored_span[1] - item.stored_span[0])
        primaries.setdefault(span, item)
    return primaries


def _raise_first(own: Exception | None, others: list[BaseException]) -> None:
    """This rank's error, else the first other rank's: every rank stops together."""
    if own is not None:
        raise own
    if others:
        raise others[0]
