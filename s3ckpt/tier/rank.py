"""``RankTier``: the memory tier as one rank of a manager sees it.

Built once, at the manager's construction (one all-gather of node names gives every rank
the same replica layout, :mod:`s3ckpt.tier.peers`, and rank 0's fresh lineage token).
The lineage names the saves that continue one another: every copy carries it, and a
restore assembles a step only from copies of one lineage. Each construction starts a new
one (a restarted job's saves are not the old job's, even at the same step numbers), and
so does each rollback (:meth:`RankTier.discard_above`, derived from the old one, the
same on every rank with no collective). Each save asks it where the copy is
held and what is exchanged with peers (:meth:`RankTier.hold`); ``load_latest`` asks it to
restore (:mod:`s3ckpt.tier.restore`); the manager's reports (``held_steps``,
``replicated_steps``) are one all-gather of what each rank holds.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from s3ckpt.background.protocol import HoldRequest
from s3ckpt.background.replicate import ReceiveIntoModel, ReplicaExchange, exchange
from s3ckpt.background.trainer_side import TierHold
from s3ckpt.tier.copies import Holdings, LocalCopies, Version
from s3ckpt.tier.options import MemoryTier
from s3ckpt.tier.peers import replica_sources, replica_targets
from s3ckpt.tier.restore import Gather, Restored, restore_from_memory

log = logging.getLogger("s3ckpt.tier")


class RankTier:
    """One rank's memory tier: its copies, its peers, its saves' holds, its restores."""

    def __init__(
        self,
        tier: MemoryTier,
        run: str,
        rank: int,
        world: int,
        gather: Gather,
        process_group: dist.ProcessGroup | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.tier, self.run, self.rank, self.world = tier, run, rank, world
        self._gather = gather
        self._tidied = False
        reports = gather((tier.node_name(), secrets.token_hex(8)))
        nodes = [node for node, _ in reports]
        self.lineage: str = reports[0][1]
        self._local_ranks = {r for r, node in enumerate(nodes) if node == nodes[rank]}
        self.targets = replica_targets(nodes, tier.replicas)
        self.replicating = any(self.targets)  # the same on every rank
        self.copies = LocalCopies(tier, run, rank, world, replica_sources(self.targets, rank))
        # a restore's fetches from peers: a gloo group of the manager's ranks, made here,
        # where every rank constructs the manager (never the loop's own groups); its
        # collectives wait ``timeout_s`` (default: a new group's, half an hour), as the
        # checkpoint processes' do, so a peer cut off mid-fetch fails the restore in time
        self._fetch_group = None
        if self.replicating:
            ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
            timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
            self._fetch_group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)

    def hold(self, step: int) -> TierHold:
        """Where this save's copy is held (that slot emptied first), and, with several
        nodes, what is sent to and received from peers once it is. The first save frees
        what an earlier layout of the job left on the node (its restore is over)."""
        if not self._tidied:
            self.copies.tidy(self._local_ranks)
            self._tidied = True
        slot = self.copies.next_slot()
        self.copies.invalidate(slot)
        folder = str(self.copies.slots[slot])
        replicate = None
        if self.replicating:
            replicate = ReplicaExchange(
                tuple((peer, folder) for peer in self.targets[self.rank]),
                tuple(
                    (source, str(self.copies.next_replica_folder(source)))
                    for source in self.copies.replicas
                ),
            )
        request = HoldRequest(
            folder, step, self.rank, self.world, self.run, replicate=replicate, lineage=self.lineage
        )
        return TierHold(slot, request)

    def held_steps(self) -> list[int]:
        """Steps every rank holds its own complete copy of (of one lineage)."""
        return sorted({step for step, _ in _held_by_all(self._gather(self.copies.holdings()))})

    def replicated_steps(self) -> list[int]:
        """Steps every rank holds, each rank's copy also on all of its replica peers."""
        every: list[Holdings] = self._gather(self.copies.holdings())
        return sorted(
            {
                version[0]
                for version in _held_by_all(every)
                if all(
                    version in every[peer].replicas.get(rank, [])
                    for rank, peers in enumerate(self.targets)
                    for peer in peers
                )
            }
        )

    def restore(
        self, state_dict: dict[str, Any], s3_latest: int | None, planner: Any = None
    ) -> Restored | None:
        return restore_from_memory(
            state_dict, self.copies, self._gather, s3_latest, self._fetch, planner,
            receive=self._receive,
        )  # fmt: skip

    def _fetch(self, plan: ReplicaExchange) -> None:
        exchange(plan, group=self._fetch_group)

    def _receive(self, peer: int) -> ReceiveIntoModel:
        return ReceiveIntoModel(peer, self._fetch_group)

    def discard_above(self, step: int) -> None:
        """The run goes on from ``step`` (every rank calls it): the copies above it are
        dropped, and the saves from now on carry a new lineage."""
        self.copies.discard_above(step)
        self.lineage = _succeeding(self.lineage, step)

    def close(self) -> None:
        group, self._fetch_group = self._fetch_group, None
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except Exception:  # the default group may be gone already
                log.debug("could not destroy the memory tier's group", exc_info=True)


def _held_by_all(every: list[Holdings]) -> set[Version]:
    return set(every[0].own).intersection(*(h.own for h in every[1:]))


def _succeeding(lineage: str, step: int) -> str:
    """The lineage of the saves that go on from ``step`` of ``lineage``."""
    return hashlib.sha256(f"{lineage}/{step}".encode()).hexdigest()[:16]
