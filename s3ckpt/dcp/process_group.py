"""The collectives a reader issues, on the process group its caller gave it and no other.

DCP calls ``StorageReader.read_metadata()`` on every rank of a load without saying which
group the load runs on. Sharing one read between ranks needs a collective, and a
collective on the wrong group hangs or pairs with someone else's: so the group is only
ever the one passed explicitly (``S3StorageReader(process_group=...)``, which the manager
and the integrations pass), never one inferred from the caller.

Shared ranges travel between ranks as host tensors (gloo) or, where the group has a
backend that carries device memory for the destination's device type (NCCL for CUDA),
as device tensors: :func:`carriage` decides which, from the group's backend alone, so
every rank of a load decides alike.
"""

from __future__ import annotations

import enum
import functools
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


class Carry(enum.Enum):
    """How a shared range travels from the rank that fetched it to the others."""

    HOST = "host"  # host tensors, on the group's CPU backend (gloo)
    DEVICE = "device"  # tensors in the destination's device memory (NCCL for CUDA)


# Backends that carry tensors in device memory, and the device type each one carries.
# Gloo's point-to-point sends read and write host memory only; they carry host tensors.
DEVICE_BACKENDS: dict[str, str] = {"nccl": "cuda"}


def carriage(backend: str, device_type: str) -> Carry | None:
    """How bytes bound for ``device_type`` memory travel over a group whose backend is
    ``backend`` (``torch.distributed.get_backend_config``'s ``"cpu:gloo,cuda:nccl"``, or
    one name for every device type, ``"nccl"``).

    In device memory where the group's backend for that device type carries it (NCCL for
    CUDA): no host buffer of the item's size on either side. Else as host tensors, where
    the group has a backend for host memory that is not device-only. ``None``: the group
    carries neither (an NCCL-only group and a CPU destination), so each rank needing the
    range reads it itself.
    """
    name = _backend_for(backend, device_type)
    if name is not None and DEVICE_BACKENDS.get(name) == device_type:
        return Carry.DEVICE
    host = _backend_for(backend, "cpu")
    if host is None or host in DEVICE_BACKENDS:
        return None
    return Carry.HOST


def _backend_for(backend: str, device_type: str) -> str | None:
    pairs = [pair.strip().lower() for pair in backend.split(",") if pair.strip()]
    if len(pairs) == 1 and ":" not in pairs[0]:
        return pairs[0]
    table = dict(pair.split(":", 1) for pair in pairs if ":" in pair)
    return table.get(device_type)


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

    @functools.cached_property
    def backend(self) -> str:
        """The group's backend for each device type, ``"cpu:gloo,cuda:nccl"``."""
        return dist.get_backend_config(self.group)

    def carries(self, device_type: str) -> Carry | None:
        """How this group carries bytes bound for ``device_type`` memory (:func:`carriage`)."""
        return carriage(self.backend, device_type)

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

    def ready(self, device_type: str) -> None:
        """One tiny all-reduce on ``device_type`` tensors, on every rank of the group.

        NCCL sets up a group's communicator in its first collective, in which every rank
        must take part; batched sends between some of the ranks come after it.
        """
        dist.all_reduce(torch.zeros(1, device=device_type), group=self.group)

    def exchange(self, batches: list[tuple[list[Transfer], list[Transfer]]]) -> None:
        """Point-to-point transfers of byte tensors, all posted at once, then awaited.

        Every rank passes the transfers it takes part in, from one schedule that every
        rank computed the same way, so each send meets its receive (in order between two
        ranks: NCCL matches them by order, not by tag). A batch holds the ``(sends,
        receives)`` of one kind of memory: a batch is coalesced on one backend.
        """
        works = [work for sends, receives in batches for work in self._post(sends, receives)]
        for work in works:
            work.wait()

    def _post(self, sends: list[Transfer], receives: list[Transfer]) -> list[dist.Work]:
        ops = [
            dist.P2POp(dist.isend, tensor, dist.get_global_rank(self.group, peer), self.group, tag)
            for tensor, peer, tag in sends
        ] + [
            dist.P2POp(dist.irecv, tensor, dist.get_global_rank(self.group, peer), self.group, tag)
            for tensor, peer, tag in receives
        ]
        return dist.batch_isend_irecv(ops) if ops else []


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
