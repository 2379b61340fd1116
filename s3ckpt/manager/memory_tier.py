"""The manager's memory tier (``memory_tier=MemoryTier(...)``, :mod:`s3ckpt.tier`), wired
to its saves and loads: the rank's tier made at construction (process mode only), its
slots handed to the checkpoint process, which steps also go to S3, a restore from memory,
and when each save's copy was held and replicated (for its metrics).

Every function takes the manager's ``RankTier``, or None without a memory tier.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from s3ckpt.background.ranks import Ranks
from s3ckpt.config import S3URI
from s3ckpt.dcp.load_report import strict_loads
from s3ckpt.errors import ConfigError
from s3ckpt.manager.ledger import InFlight
from s3ckpt.tier.options import MemoryTier
from s3ckpt.tier.rank import RankTier
from s3ckpt.tier.restore import Restored

if TYPE_CHECKING:
    from s3ckpt.background.trainer_side import TierHold


def check_mode(memory_tier: MemoryTier | None, async_mode: str) -> None:
    """A memory tier needs process mode: the checkpoint process records the held copies."""
    if memory_tier is not None and async_mode != "process":
        raise ConfigError(
            f"memory_tier needs async_mode='process' (the checkpoint process records the "
            f"held copies), not {async_mode!r}"
        )


def rank_tier(
    memory_tier: MemoryTier | None,
    location: S3URI,
    ranks: Ranks,
    process_group: dist.ProcessGroup | None,
    timeout_s: float,
) -> RankTier | None:
    """This rank's tier for the run at ``location``; None without a memory tier."""
    if memory_tier is None:
        return None
    return RankTier(
        memory_tier, str(location), ranks.rank, ranks.world, ranks.gather, process_group,
        timeout_s,
    )  # fmt: skip


def saver_memory(tier: RankTier | None, memory_tier: MemoryTier | None) -> dict[str, Any]:
    """The background saver's keywords for the tier: the slots it stages into, and their
    size limit."""
    slots = tier.copies.slots if tier is not None else ()
    limit = {"slot_limit": memory_tier.max_bytes} if memory_tier is not None else {}
    return {"memory_slots": slots, **limit}


def goes_to_s3(memory_tier: MemoryTier | None, step: int, s3: bool | None) -> bool:
    """Whether a save of ``step`` is uploaded: always without a memory tier, else as ``s3``
    says (default: ``MemoryTier.to_s3(step)``)."""
    return memory_tier is None or (memory_tier.to_s3(step) if s3 is None else s3)


def restore_from_memory(
    tier: RankTier | None, state_dict: dict[str, Any], step: int | None, strict: bool
) -> Restored | None:
    """The step the whole job holds intact in memory, at least as new as S3's newest
    ``step``, loaded into ``state_dict``; None (nothing loaded) when there is none."""
    if tier is None:
        return None
    with strict_loads(strict):
        return tier.restore(state_dict, step)


def time_the_copies(hold: TierHold, inflight: InFlight) -> None:
    """Record on ``inflight`` when its copy is held in memory and when it is replicated."""
    hold.held.add_done_callback(lambda _: setattr(inflight, "held_at", time.perf_counter()))
    hold.replicated.add_done_callback(
        lambda _: setattr(inflight, "replicated_at", time.perf_counter())
    )
