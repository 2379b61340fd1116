"""The collectives a reader issues, on the process group its caller gave it and no other.

DCP calls ``StorageReader.read_metadata()`` on every rank of a load without saying which
group the load runs on. Sharing one read between ranks needs a collective, and a
collective on the wrong group hangs or pairs with someone else's: so the group is only
ever the one passed explicitly (``S3StorageReader(process_group=...)``, which the manager
and the integrations pass), never one inferred from the caller.
"""

from __future__ import annotations

import pickle
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

from s3ckpt.errors import ConfigError, S3CkptError

_T = TypeVar("_T")


class SharedReads(Protocol):
    """Who reads for a group of ranks, and how the others receive it."""

    is_coordinator: bool

    def broadcast_object(self, value: _T | None) -> _T: ...


Transfer = tuple[torch.Tensor, int, int]  # (uint8 tensor, peer's rank in the group, tag)


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

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def all_gather(self, value: _T) -> list[_T]:
        """Every rank's ``value``, in group rank order (one small collective)."""
        gathered: list[_T] = [None] * self.size  # type: ignore[list-item]
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def exchange(self, sends: list[Transfer], receives: list[Transfer]) -> None:
        """Point-to-point transfers of byte tensors, all posted at once, then awaited.

        Every rank passes the transfers it takes part in, from one schedule that every
        rank computed the same way, so each send meets its receive.
        """
        ops = [
            dist.P2POp(dist.isend, tensor, dist.get_global_rank(self.group, peer), self.group, tag)
            for tensor, peer, tag in sends
        ] + [
            dist.P2POp(dist.irecv, tensor, dist.get_global_rank(self.group, peer), self.group, tag)
            for tensor, peer, tag in receives
        ]
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (to be sent to the other ranks), else an
    :class:`~s3ckpt.errors.S3CkptError` with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return S3CkptError(f"{type(exc).__name__}: {exc}")
    return exc


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
