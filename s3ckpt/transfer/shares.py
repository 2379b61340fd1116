"""Which rank fetches which stored byte range, when several ranks of a load need it.

Replicated state (DDP's full copies, HSDP's replica groups) makes every replica read the
same stored bytes: at 232 replicas a 1.1 TB checkpoint costs about 255 TB of GETs per
restart. Given every rank's needs, :func:`plan_shares` gives each range that two or more
ranks need to one of them, which fetches it once from the store and passes it on to the
others over the process group; a range only one rank needs stays that rank's own read.

The plan is a pure function of the ranks' needs, so every rank computes the same one from
the same all-gathered lists and no further agreement is needed. Ranges go to the needing
rank with the fewest bytes assigned so far, largest ranges first (longest processing
time first: within 4/3 of the best balance), ties to the lowest rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

Span = tuple[str, int, int]  # object key (relative to the checkpoint), first stored byte, end


@dataclass(frozen=True)
class SharePlan:
    """Who fetches each range needed by several ranks, and who receives it."""

    owners: dict[Span, int] = field(default_factory=dict)
    receivers: dict[Span, tuple[int, ...]] = field(default_factory=dict)
    tags: dict[Span, int] = field(default_factory=dict)  # one per range, the same everywhere

    @property
    def shared(self) -> bool:
        return bool(self.owners)

    def fetched_by(self, rank: int) -> dict[Span, int]:
        """The shared ranges ``rank`` fetches, with the bytes each costs."""
        return {s: s[2] - s[1] for s, owner in self.owners.items() if owner == rank}

    def sends(self, rank: int) -> list[tuple[Span, int]]:
        """``(range, receiving rank)`` for every range ``rank`` passes on, in tag order."""
        return [
            (span, peer)
            for span in sorted(self.owners, key=self.tags.__getitem__)
            if self.owners[span] == rank
            for peer in self.receivers[span]
        ]

    def receives(self, rank: int) -> list[tuple[Span, int]]:
        """``(range, fetching rank)`` for every range ``rank`` gets from another."""
        return [
            (span, self.owners[span])
            for span in sorted(self.owners, key=self.tags.__getitem__)
            if rank in self.receivers[span]
        ]


def plan_shares(needs: Sequence[Sequence[Span]], first_tag: int = 0) -> SharePlan:
    """The plan for ranks whose needs are ``needs[rank]`` (ranges, each listed once), its
    tags numbered from ``first_tag`` (plans of one load that travel together need tags of
    their own)."""
    needers: dict[Span, list[int]] = {}
    for rank, spans in enumerate(needs):
        for span in dict.fromkeys(spans):
            if span[2] > span[1]:
                needers.setdefault(span, []).append(rank)
    shared = sorted(
        (s for s, ranks in needers.items() if len(ranks) > 1), key=lambda s: (s[1] - s[2], s)
    )
    load = [0] * len(needs)
    for span, ranks in needers.items():  # what each rank reads alone counts towards its share
        if len(ranks) == 1:
            load[ranks[0]] += span[2] - span[1]
    owners: dict[Span, int] = {}
    for span in shared:
        owner = min(needers[span], key=lambda r: (load[r], r))
        owners[span] = owner
        load[owner] += span[2] - span[1]
    receivers = {s: tuple(r for r in needers[s] if r != owners[s]) for s in owners}
    tags = {span: number for number, span in enumerate(sorted(owners), first_tag)}
    return SharePlan(owners, receivers, tags)
