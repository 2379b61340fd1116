"""The ranks a ``CheckpointManager`` (or a ``TieredCheckpointProcess``) agrees with, and
the few collectives it needs.

Every decision that could differ between ranks (skip a busy save, whether a step is
committed) is taken once and shared, so that no rank starts a save, or a collective,
alone. Rank 0 asks the store and hands its answer, or its error, to :meth:`Ranks.from_rank0`;
the others receive it there, and raise the error too rather than hang.

Background saves run their collectives on groups of their own
(:mod:`s3ckpt.background`), so they never interleave with the training loop's; the first
of them, :func:`raise_copy_failures`, fails a save on every rank when one rank could not
copy its state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from s3ckpt.errors import CheckpointError

if TYPE_CHECKING:
    from s3ckpt.background.protocol import CopyFailure

T = TypeVar("T")


class Ranks:
    """The process group of a manager (or this process alone, without torch.distributed)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0

    def shared(self) -> dist.ProcessGroup | None:
        """The group a load's readers share their metadata read over (every rank of it
        loads): the manager's own, ``None`` for a lone rank."""
        if not self.distributed or self.world == 1:
            return None
        return self.group if self.group is not None else dist.group.WORLD

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (one all-gather)."""
        return any(self.gather(flag))

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (one all-gather)."""
        if self.world == 1:
            return [value]
        values: list[Any] = [None] * self.world
        dist.all_gather_object(values, value, group=self.group)
        return values

    def from_rank0(self, outcome: T | Exception | None) -> T:
        """Rank 0's ``outcome`` on every rank (one broadcast): what it found, returned, or
        the error it met, raised on every rank rather than the others hanging. Rank 0
        passes its own; the others pass None, which is not read."""
        shared = self._broadcast(outcome)
        if isinstance(shared, BaseException):
            raise shared
        return shared

    def _broadcast(self, value: Any) -> Any:
        if self.world == 1:
            return value
        box = [value]
        source = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(box, src=source, group=self.group)
        return box[0]


def raise_copy_failures(failure: CopyFailure | None, group: Any = None) -> None:
    """Raise, on every rank of ``group`` (default: the default group), the first rank's
    copy failure, if any rank had one; every rank calls it before its save's first
    collective, so no rank waits for one that has nothing to save and nothing is
    written. One all-reduce; the reasons are gathered only when a copy failed."""
    failed = torch.tensor([int(failure is not None)], dtype=torch.int64)
    dist.all_reduce(failed, group=group)
    if not int(failed):
        return
    reasons: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, None if failure is None else failure.reason, group=group)
    raise CheckpointError(next(reason for reason in reasons if reason))
