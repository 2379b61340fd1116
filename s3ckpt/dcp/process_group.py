"""The collectives a reader issues, on the process group its caller gave it and no other.

DCP calls ``StorageReader.read_metadata()`` on every rank of a load without saying which
group the load runs on. Sharing one read between ranks needs a collective, and a
collective on the wrong group hangs or pairs with someone else's: so the group is only
ever the one passed explicitly (``S3StorageReader(process_group=...)``, which the manager
and the integrations pass), never one inferred from the caller.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch.distributed as dist

from s3ckpt.errors import ConfigError

_T = TypeVar("_T")


class SharedReads(Protocol):
    """Who reads for a group of ranks, and how the others receive it."""

    is_coordinator: bool

    def broadcast_object(self, value: _T | None) -> _T: ...


class GroupBroadcast:
    """:class:`SharedReads` over a ``torch.distributed`` process group: its rank 0 reads."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        rank = dist.get_rank(group)
        if rank < 0:
            raise ConfigError(
                "this rank is not in the process_group given to S3StorageReader: pass the "
                "group that runs the load on every rank of it"
            )
        self.group = group
        self.is_coordinator = rank == 0
        self._source = dist.get_global_rank(group, 0)

    def broadcast_object(self, value: _T | None) -> _T:
        box = [value]
        dist.broadcast_object_list(box, src=self._source, group=self.group)
        return box[0]  # type: ignore[return-value]


def shared_reads(group: dist.ProcessGroup | None) -> SharedReads | None:
    """Collectives over ``group``; ``None`` (each rank reads alone) without a group, or
    with one of a single rank."""
    if group is None:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(group) <= 1:
        return None
    return GroupBroadcast(group)
