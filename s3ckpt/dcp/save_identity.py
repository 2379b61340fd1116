"""Which save a rank writes for, whatever its planner caches or replays.

The coordinator names a save (its save id) in the plans it returns from
``prepare_global_plan``; every object key, the rank's index object and the in-flight
record carry that id, so two saves never write to one key and an overwrite never touches
the objects of the checkpoint it replaces.

Planners that cache plans break the channel. With ``DefaultSavePlanner(
enable_plan_caching=True)`` an unchanged local plan travels as ``SavePlan([],
usable=False)`` and ``finish_plan`` hands ``write_data`` the final plan cached at the first
save, ``storage_data`` included; Megatron-core's ``--ckpt-assume-constant-structure``
reuses its cached central plan the same way, without planning at all. Written as it is,
such a plan puts the new save's bytes under the keys of the save it was cached from: the
committed checkpoint being replaced, before the new manifest exists.

So a rank assignment is written under at most once per process. :func:`claim` records the
assignments used; one used already is a replay and gets a successor derived from it and
from how many times it was replayed. Every rank replaying the same cached plan derives the
same id without a collective (all ranks of a save replay in step, as each save is
collective). Ranks whose plans changed while others replay get the coordinator's fresh id:
their ids then differ, which loading tolerates (the manifest lists every key it commits);
the coordinator clears every in-flight record the ranks used.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

from s3ckpt.errors import ConfigError


@dataclass(frozen=True)
class RankAssignment:
    """What the coordinator tells each rank in ``SavePlan.storage_data``."""

    rank: int
    save_id: str


_lock = threading.Lock()
_replays: dict[RankAssignment, int] = {}  # assignments written under -> times replayed


def claim(storage_data: object, rank: int) -> RankAssignment:
    """The assignment ``write_data`` writes under for a plan carrying ``storage_data``.

    A plan that carries no assignment (a planner that rebuilt the plan and dropped it) or
    another rank's is refused: writing it would put this rank's bytes under another
    rank's keys.
    """
    if not isinstance(storage_data, RankAssignment):
        raise ConfigError(
            "the save plan carries no S3StorageWriter rank assignment (storage_data is "
            f"{type(storage_data).__name__}): a planner must keep the storage_data of the "
            "plan it was given"
        )
    if storage_data.rank != rank:
        raise ConfigError(
            f"rank {rank} was handed the save plan of rank {storage_data.rank}; refusing to "
            "write it under that rank's object keys"
        )
    with _lock:
        replayed = _replays.get(storage_data)
        _replays[storage_data] = 0 if replayed is None else replayed + 1
    if replayed is None:
        return storage_data
    return RankAssignment(storage_data.rank, successor(storage_data.save_id, replayed + 1))


def successor(save_id: str, replay: int) -> str:
    """The save id of the ``replay``-th replay of a plan named ``save_id``: as random
    as the id it derives from, and the same on every rank."""
    digest = hashlib.blake2b(f"{save_id}/{replay}".encode(), digest_size=8).hexdigest()
    return digest[: len(save_id)] if len(save_id) <= 16 else digest
