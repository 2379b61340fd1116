"""One rank's copies in the memory tier: its slots on the node, what they hold, which to
write next.

Layout: ``<root>/run-<id>/rank-<r>/slot-<i>/`` (``<id>`` names the run's S3 location;
``run.txt`` beside the ranks spells it out), each slot a staging arena's segment files
plus the held copy's state and descriptor (:mod:`s3ckpt.background.held`).

The rules that keep a restore safe:

* a save writes the slot that does not hold the newest copy (with ``keep >= 2``), and
  removes that slot's descriptor before its first byte is copied, so the slot holds
  nothing until the new copy is complete;
* a copy counts only for its own run, rank and world size;
* after a rollback (a load of step ``L``), copies above ``L`` are the abandoned run's:
  :meth:`LocalCopies.discard_above` removes their descriptors on every rank.

Torch-free: the CLI reads it.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from s3ckpt.background import held
from s3ckpt.tier.options import MemoryTier


def run_folder(root: Path, run: str) -> Path:
    """The folder of the run checkpointed to ``run`` (an ``s3://`` location)."""
    return root / f"run-{hashlib.sha256(run.encode()).hexdigest()[:16]}"


@dataclass(frozen=True)
class HeldSlot:
    """A slot and the complete copy it holds."""

    slot: int
    folder: Path
    held: held.Held


class LocalCopies:
    """The memory-tier slots of one rank of one run."""

    def __init__(self, tier: MemoryTier, run: str, rank: int, world: int) -> None:
        self.tier, self.run, self.rank, self.world = tier, run, rank, world
        self.run_folder = run_folder(tier.root, run)
        self.folder = self.run_folder / f"rank-{rank:05d}"
        tier.check_room(self.run_folder)
        self.slots = [self.folder / f"slot-{index}" for index in range(tier.keep)]
        for slot in self.slots:
            slot.mkdir(parents=True, exist_ok=True)
        (self.run_folder / "run.txt").write_text(run + "\n")

    def held(self) -> list[HeldSlot]:
        """The complete copies this rank holds for this run and world size, newest step
        first."""
        found = []
        for index, folder in enumerate(self.slots):
            record = held.read(folder)
            if record is not None and self._mine(record):
                found.append(HeldSlot(index, folder, record))
        return sorted(found, key=lambda h: h.held.step, reverse=True)

    def next_slot(self) -> int:
        """The slot the next save writes: an empty one, else the one with the oldest copy
        (never the newest while there is another)."""
        holding = {h.slot: h.held.created for h in self.held()}
        empty = [index for index in range(len(self.slots)) if index not in holding]
        if empty:
            return empty[0]
        return min(holding, key=holding.__getitem__)

    def invalidate(self, slot: int) -> None:
        """Make ``slot`` hold nothing, before a save writes it."""
        held.invalidate(self.slots[slot])

    def discard_above(self, step: int) -> None:
        """Forget the copies of steps above ``step`` (the run rolled back to it)."""
        for h in self.held():
            if h.held.step > step:
                held.invalidate(h.folder)

    def _mine(self, record: held.Held) -> bool:
        return (record.run, record.rank, record.world) == (self.run, self.rank, self.world)


@dataclass(frozen=True)
class NodeCopy:
    """A copy found under a root, for listing (``s3ckpt memory``)."""

    run: str
    folder: Path
    held: held.Held


def node_copies(root: Path) -> list[NodeCopy]:
    """Every complete copy under ``root``, by run, step and rank."""
    found = []
    for folder in sorted(root.glob("run-*/rank-*/slot-*")):
        record = held.read(folder)
        if record is not None:
            found.append(NodeCopy(record.run, folder, record))
    return sorted(found, key=lambda c: (c.run, -c.held.step, c.held.rank))


def remove_run(root: Path, run: str) -> int:
    """Remove every copy of ``run`` under ``root``; the bytes freed."""
    folder = run_folder(root, run)
    freed = sum(p.stat().st_size for p in folder.glob("rank-*/slot-*/*") if p.is_file())
    shutil.rmtree(folder, ignore_errors=True)
    return freed
