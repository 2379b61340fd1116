"""Which peers hold each rank's replicas: a pure function of the job's node layout.

Nodes are ordered as their first ranks are (rank order); a rank's ``k``-th replica goes
to the node ``k`` places after its own in that ring, to the rank there with the same
local index (modulo that node's ranks). So replicas always land on other nodes, spread
evenly when nodes have the same number of ranks, and every rank computes the same layout
from one all-gather of node names.
"""

from __future__ import annotations

from collections.abc import Sequence


def replica_targets(nodes: Sequence[str], replicas: int) -> list[list[int]]:
    """For each rank (``nodes[rank]`` is its node), the ranks its copy is sent to: at most
    ``replicas``, never on its own node, none when there is one node."""
    order = list(dict.fromkeys(nodes))
    members = {node: [rank for rank, n in enumerate(nodes) if n == node] for node in order}
    targets = []
    for rank, node in enumerate(nodes):
        local, at = members[node].index(rank), order.index(node)
        mine = []
        for k in range(1, min(replicas, len(order) - 1) + 1):
            there = members[order[(at + k) % len(order)]]
            mine.append(there[local % len(there)])
        targets.append(mine)
    return targets


def replica_sources(targets: Sequence[Sequence[int]], rank: int) -> list[int]:
    """The ranks whose copies ``rank`` receives."""
    return [source for source, theirs in enumerate(targets) if rank in theirs]
