"""One rank's copies in the memory tier: its slots on the node, what they hold, which to
write next.

Layout: ``<root>/run-<id>/rank-<r>/slot-<i>/`` (``<id>`` names the run's S3 location;
``run.txt`` beside the ranks spells it out), each slot a staging arena's segment files
plus the held copy's state and descriptor (:mod:`s3ckpt.background.held`).

The rules that keep a restore safe:

* a save writes the slot that does not hold the newest copy (with ``keep >= 2``), and
  removes that slot's descriptor before its first byte is copied, so the slot holds
  nothing until the new copy is complete;
* a copy counts as a rank's own only for its own run, rank and world size; the copies
  of a job with another world size count together, all of one step or none
  (:meth:`LocalCopies.other_worlds`), until the new layout's first save frees them;
* after a rollback (a load of step ``L``), copies above ``L`` are the abandoned run's:
  :meth:`LocalCopies.discard_above` removes their descriptors on every rank;
* a step is named by its number and its lineage (:data:`Version`): copies of one step
  number make up one checkpoint only when they carry the same lineage, so copies that an
  abandoned timeline left on a node no rank of the rollback ran on (its ranks moved
  elsewhere) are never assembled with the new timeline's.

Torch-free: the CLI reads it.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from s3ckpt.background import held
from s3ckpt.tier.options import MemoryTier

Version = tuple[int, str]
"""A held step: its number and the lineage of the saves it belongs to."""
OldStep = tuple[int, int, str]
"""A step saved with another world size: that world size, the step, its lineage."""


def run_folder(root: Path, run: str) -> Path:
    """The folder of the run checkpointed to ``run`` (an ``s3://`` location)."""
    return root / f"run-{hashlib.sha256(run.encode()).hexdigest()[:16]}"


@dataclass(frozen=True)
class HeldSlot:
    """A slot and the complete copy it holds."""

    slot: int
    folder: Path
    held: held.HeldRecord

    @property
    def version(self) -> Version:
        return (self.held.step, self.held.lineage)


class SlotSet:
    """``keep`` slots holding copies of one rank's state (this rank's own, or a peer's
    replicas), and which of them the next copy goes to."""

    def __init__(self, folder: Path, keep: int, run: str, rank: int, world: int) -> None:
        self.folders = [folder / f"slot-{index}" for index in range(keep)]
        self._whose = (run, rank, world)
        for slot in self.folders:
            slot.mkdir(parents=True, exist_ok=True)

    def held(self) -> list[HeldSlot]:
        """The complete copies held, newest step first."""
        found = []
        for index, folder in enumerate(self.folders):
            record = held.read(folder)
            if record is not None and (record.run, record.rank, record.world) == self._whose:
                found.append(HeldSlot(index, folder, record))
        return sorted(found, key=lambda h: h.held.step, reverse=True)

    def next_slot(self) -> int:
        """The slot the next copy goes to: an empty one, else the one with the oldest copy
        (never the newest while there is another)."""
        holding = {h.slot: h.held.created for h in self.held()}
        empty = [index for index in range(len(self.folders)) if index not in holding]
        if empty:
            return empty[0]
        return min(holding, key=holding.__getitem__)

    def invalidate(self, slot: int) -> None:
        """Make ``slot`` hold nothing, before a copy is written there."""
        held.invalidate(self.folders[slot])

    def discard_above(self, step: int) -> None:
        for h in self.held():
            if h.held.step > step:
                held.invalidate(h.folder)

    def forget_others(self) -> None:
        """Empty the slots holding a copy that is not this set's (another world size)."""
        for folder in self.folders:
            record = held.read(folder)
            if record is not None and (record.run, record.rank, record.world) != self._whose:
                held.invalidate(folder)


class LocalCopies:
    """The memory-tier slots of one rank of one run: its own copies, and the replicas it
    keeps for the ranks in ``sources`` (peers on other nodes)."""

    def __init__(
        self, tier: MemoryTier, run: str, rank: int, world: int, sources: Sequence[int] = ()
    ) -> None:
        self.tier, self.run, self.rank, self.world = tier, run, rank, world
        self.run_folder = run_folder(tier.root, run)
        self.folder = self.run_folder / f"rank-{rank:05d}"
        tier.check_room(self.run_folder, copies_per_rank=tier.keep * (1 + len(sources)))
        self.own = SlotSet(self.folder, tier.keep, run, rank, world)
        self.replicas = {
            source: SlotSet(self.folder / f"replica-of-{source:05d}", tier.keep, run, source, world)
            for source in sources
        }
        (self.run_folder / "run.txt").write_text(run + "\n")

    @property
    def slots(self) -> list[Path]:
        """This rank's own slots (the staging arenas' folders)."""
        return self.own.folders

    def held(self) -> list[HeldSlot]:
        """This rank's own complete copies, newest step first."""
        return self.own.held()

    def next_slot(self) -> int:
        return self.own.next_slot()

    def invalidate(self, slot: int) -> None:
        self.own.invalidate(slot)

    def next_replica_folder(self, source: int) -> Path:
        """The (emptied) folder the next replica of ``source``'s copy goes to."""
        replicas = self.replicas[source]
        slot = replicas.next_slot()
        replicas.invalidate(slot)
        return replicas.folders[slot]

    def own_copy(self, version: Version) -> HeldSlot | None:
        """This rank's own copy of ``version`` held here, if any."""
        return _of_version(self.own, version)

    def replica_of(self, source: int, version: Version) -> HeldSlot | None:
        """The replica of ``source``'s copy of ``version`` held here, if any."""
        replicas = self.replicas.get(source)
        return _of_version(replicas, version) if replicas else None

    def holdings(self) -> Holdings:
        """What this rank holds: its own versions, and each source's replicated ones."""
        return Holdings(
            [h.version for h in self.own.held()],
            {source: [h.version for h in slots.held()] for source, slots in self.replicas.items()},
        )

    def discard_above(self, step: int) -> None:
        """Forget the copies of steps above ``step`` (the run rolled back to it)."""
        self.own.discard_above(step)
        for replicas in self.replicas.values():
            replicas.discard_above(step)

    def _stale(self, folder: Path) -> bool:
        """Whether ``folder`` (a rank's) holds copies, all of another world size or run
        (never a folder being filled, nor one holding this layout's copies)."""
        records = [held.read(slot) for slot in [*folder.glob("slot-*"), *folder.glob("*/slot-*")]]
        found = [r for r in records if r is not None]
        return bool(found) and all((r.run, r.world) != (self.run, self.world) for r in found)

    def other_worlds(self) -> dict[OldStep, dict[int, tuple[Path, held.HeldRecord]]]:
        """The run's steps saved with another world size whose every rank's copy this
        node holds (each rank's own copy, else a replica of it), all of one lineage:
        ``(world, step, lineage)`` -> old rank -> its folder and descriptor."""
        found: dict[OldStep, dict[int, tuple[Path, held.HeldRecord]]] = {}
        for copy in node_copies(self.tier.root, self.run_folder.name):  # own before replicas
            record = copy.held
            if record.run == self.run and record.world != self.world:
                steps = found.setdefault((record.world, record.step, record.lineage), {})
                steps.setdefault(record.rank, (copy.folder, record))
        return {key: ranks for key, ranks in found.items() if len(ranks) == key[0]}

    def tidy(self, local_ranks: Collection[int] = ()) -> None:
        """Free what this layout no longer uses on the node: the folders of ranks beyond
        the world size, those of ranks now on another node (``local_ranks``: this node's)
        that hold only another world size's copies, the replicas this rank no longer
        keeps, and the copies of another world size in this rank's slots. Called once
        the job has restored (or not) and saves again: until then, those copies are what
        a resharding restore reads."""
        for folder in self.run_folder.glob("rank-*"):
            rank = _rank_of(folder.name, "rank-")
            moved = rank not in local_ranks and rank != self.rank and self._stale(folder)
            if rank >= self.world or moved:
                shutil.rmtree(folder, ignore_errors=True)  # ranks on the node race: fine
        for folder in self.folder.glob("replica-of-*"):
            if _rank_of(folder.name, "replica-of-") not in self.replicas:
                shutil.rmtree(folder, ignore_errors=True)
        for slots in (self.own, *self.replicas.values()):
            slots.forget_others()


@dataclass(frozen=True)
class Holdings:
    """One rank's report at a restore: the steps it holds of its own state, and of each
    peer's whose replicas it keeps."""

    own: list[Version]
    replicas: dict[int, list[Version]]


@dataclass(frozen=True)
class NodeCopy:
    """A copy found under a root, for listing (``s3ckpt memory``)."""

    run: str
    folder: Path
    held: held.HeldRecord
    replica: bool = False  # a peer's copy kept here


def node_copies(root: Path, runs: str = "run-*") -> list[NodeCopy]:
    """Every complete copy under ``root`` (own copies and replicas; of the run folders
    ``runs`` matches), by run, step and rank, a rank's own copy before replicas of it."""
    found = []
    folders = [
        *root.glob(f"{runs}/rank-*/slot-*"),
        *root.glob(f"{runs}/rank-*/replica-of-*/slot-*"),
    ]
    for folder in sorted(folders):
        record = held.read(folder)
        if record is not None:
            found.append(NodeCopy(record.run, folder, record, "replica-of-" in folder.parent.name))
    return sorted(found, key=lambda c: (c.run, -c.held.step, c.held.rank, c.replica))


def _of_version(slots: SlotSet, version: Version) -> HeldSlot | None:
    return next((h for h in slots.held() if h.version == version), None)


def _rank_of(name: str, prefix: str) -> int:
    """The rank a folder named ``<prefix><rank>`` is for (-1 when it names none)."""
    digits = name.removeprefix(prefix)
    return int(digits) if digits.isdigit() else -1


def remove_run(root: Path, run: str) -> int:
    """Remove every copy of ``run`` under ``root``; the bytes freed."""
    folder = run_folder(root, run)
    freed = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    shutil.rmtree(folder, ignore_errors=True)
    return freed
