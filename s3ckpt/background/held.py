"""A held copy: one rank's staged save, kept in shared memory as a memory-tier checkpoint.

A memory-tier slot is a folder (``<root>/<run>/rank-<r>/slot-<i>/``, see
:mod:`s3ckpt.tier.copies`) that holds, besides the staging arena's segment files
(``segment-<j>``):

* ``state.pkl``: the staged state, pickled with its arena tensors by reference
  (:func:`~s3ckpt.background.channel.dumps_staged`);
* ``held.json``: written last, by an atomic rename, once every byte of the copy is in
  place and checksummed: the step, the rank and the world size it belongs to, the run, and
  the CRC32C of every region of the segments and of ``state.pkl``, and the lineage of
  saves it belongs to (a step number alone is not a save's name: a run rolled back saves
  the same step numbers again).

A slot without ``held.json`` holds nothing: the descriptor is removed before the slot is
written again, and a process killed at any point before the rename leaves no descriptor.
So a descriptor always describes bytes that were completely written; whether they are
still intact (a stray write, a torn tmpfs) is checked against its CRCs before a restore
uses them (:func:`verify`).

Torch-free, so the CLI can list what a node holds.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from crc32c import crc32c

from s3ckpt.format import checksums

FORMAT = "s3ckpt-held/1"
DESCRIPTOR = "held.json"
STATE = "state.pkl"
EMPTY_CRC = crc32c(b"")
_PIECE = 32 << 20  # bytes one thread checksums at a time (a batch)
_READ_PIECE = 4 << 20  # bytes read and then checksummed while still in the cache
_THREADS = 8


@dataclass(frozen=True)
class HeldRegion:
    """One staged storage's bytes in a segment file, and their CRC32C."""

    segment: int
    offset: int
    nbytes: int
    crc32c: int


@dataclass(frozen=True)
class HeldRecord:
    """What ``held.json`` records of one held copy."""

    step: int
    rank: int
    world: int
    run: str
    segments: tuple[int, ...]  # each segment file's size
    regions: tuple[HeldRegion, ...]
    state_crc32c: int
    nbytes: int  # the state's tensor bytes
    created: float  # time.time() when the copy was complete
    # The saves that continue one another (s3ckpt.tier.rank.RankTier.lineage): two copies
    # of one step make up the same checkpoint only if they carry the same lineage. Empty
    # in descriptors written before there was one.
    lineage: str = ""

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HeldRecord:
        fields = json.loads(text)
        if fields.pop("format", None) != FORMAT:
            raise ValueError(f"not a {FORMAT} descriptor")
        fields["segments"] = tuple(fields["segments"])
        fields["regions"] = tuple(HeldRegion(**region) for region in fields["regions"])
        return cls(**fields)


def region_crcs(maps: Sequence[Any], regions: Sequence[tuple[int, int, int]]) -> list[int]:
    """The CRC32C of each ``(segment, offset, nbytes)`` region of the segments ``maps``.

    Checked in pieces on several threads (:func:`_in_pieces`): a copy is checked at the
    cores' speed however its tensors are sized."""

    def piece_crc(index: int, start: int, length: int) -> int:
        segment, offset, _ = regions[index]
        with memoryview(maps[segment])[offset + start : offset + start + length] as view:
            return crc32c(view)

    return _in_pieces([nbytes for _, _, nbytes in regions], piece_crc)


def read_regions(
    fds: Sequence[int], reads: Sequence[tuple[int, int, memoryview]], check: bool = True
) -> list[int]:
    """Read each ``(segment, offset, target)``: ``len(target)`` bytes of segment file
    ``fds[segment]`` from ``offset`` into ``target``; the CRC32C of each read's bytes.

    Each piece is read with ``preadv`` (the kernel copies from the tmpfs pages straight
    into the target, no mapping of the source to populate) and checksummed right after,
    in ``_READ_PIECE`` steps while its bytes are still in the cache; the pieces run on
    several threads (both calls release the GIL). Without ``check``, only read (the CRCs
    returned are then those of empty pieces)."""

    def piece_crc(index: int, start: int, length: int) -> int:
        segment, offset, target = reads[index]
        crc = EMPTY_CRC
        for at in range(start, start + length, _READ_PIECE):
            with target[at : min(at + _READ_PIECE, start + length)] as chunk:
                _read_exactly(fds[segment], chunk, offset + at)
                crc = crc32c(chunk, crc) if check else crc
        return crc

    return _in_pieces([len(target) for _, _, target in reads], piece_crc)


def _read_exactly(fd: int, chunk: memoryview, offset: int) -> None:
    done = 0
    while done < len(chunk):
        got = os.preadv(fd, [chunk[done:]], offset + done)
        if got == 0:
            raise ValueError("a segment file ended before its descriptor's regions")
        done += got


def _in_pieces(lengths: Sequence[int], piece_crc: Callable[[int, int, int], int]) -> list[int]:
    """The CRC32C of each of ``len(lengths)`` byte ranges, computed by ``piece_crc(index,
    start, length)`` over pieces of them on several threads and combined per range
    (:func:`checksums.combine`).

    The ranges are cut into batches of about ``_PIECE`` bytes (a large range in several
    pieces, small ones many to a batch): a state of many small tensors costs one task per
    batch, not one per tensor."""
    batches: list[list[tuple[int, int, int]]] = [[]]
    filled = 0
    for index, nbytes in enumerate(lengths):
        for start in range(0, nbytes, _PIECE):
            length = min(_PIECE, nbytes - start)
            if filled + length > _PIECE and batches[-1]:
                batches.append([])
                filled = 0
            batches[-1].append((index, start, length))
            filled += length

    def batch_crcs(batch: list[tuple[int, int, int]]) -> list[int]:
        return [piece_crc(index, start, length) for index, start, length in batch]

    threads = min(len(batches), os.cpu_count() or 1, _THREADS)
    if threads > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="s3ckpt-crc") as pool:
            computed = list(pool.map(batch_crcs, batches))
    else:
        computed = [batch_crcs(batch) for batch in batches]
    found = [EMPTY_CRC] * len(lengths)
    for batch, crcs in zip(batches, computed, strict=True):
        for (index, start, length), crc in zip(batch, crcs, strict=True):
            found[index] = crc if start == 0 else checksums.combine(found[index], crc, length)
    return found


def damaged_region(maps: Sequence[Any], regions: Sequence[HeldRegion]) -> HeldRegion | None:
    """The first of ``regions`` whose bytes in ``maps`` do not match its CRC32C, if any."""
    if not regions:
        return None
    crcs = region_crcs(maps, [(r.segment, r.offset, r.nbytes) for r in regions])
    return next((r for r, crc in zip(regions, crcs, strict=True) if crc != r.crc32c), None)


def write(slot: Path, held: HeldRecord, state: bytes) -> None:
    """Record a complete copy in ``slot``: its state, then its descriptor, atomically last."""
    (slot / STATE).write_bytes(state)
    temporary = slot / f"{DESCRIPTOR}.tmp"
    temporary.write_text(held.to_json())
    os.replace(temporary, slot / DESCRIPTOR)


def invalidate(slot: Path) -> None:
    """Make ``slot`` hold nothing (its descriptor first), before it is written again."""
    (slot / DESCRIPTOR).unlink(missing_ok=True)
    (slot / STATE).unlink(missing_ok=True)


def read(slot: Path) -> HeldRecord | None:
    """The descriptor of ``slot``, or None if it holds no complete copy (or an unreadable one)."""
    try:
        return HeldRecord.from_json((slot / DESCRIPTOR).read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None


class MappedCopy:
    """The files of a held copy opened and mapped into this process (copy-on-write, never
    written back), to verify and read it.

    The mappings are not populated up front: a restore reads most bytes with
    :meth:`read_checked` (from the files, checksummed as they land), and only what it
    does not read that way is faulted in through the mappings (:meth:`verify`)."""

    def __init__(self, slot: Path, held: HeldRecord) -> None:
        self.slot, self.held = slot, held
        self.maps: list[mmap.mmap] = []
        self.fds: list[int] = []
        try:
            for index, size in enumerate(held.segments):
                fd = os.open(slot / f"segment-{index}", os.O_RDONLY | os.O_CLOEXEC)
                self.fds.append(fd)
                self.maps.append(_map(fd, slot / f"segment-{index}", size))
            self.state = (slot / STATE).read_bytes()
        except BaseException:
            self.close()
            raise

    def state_problem(self) -> str | None:
        """None if the staged state (what names the tensors) matches its CRC32C."""
        if crc32c(self.state) != self.held.state_crc32c:
            return f"{self.slot / STATE} does not match its CRC32C"
        return None

    def read_checked(
        self, reads: Sequence[tuple[HeldRegion, memoryview]], check: bool = True
    ) -> list[HeldRegion]:
        """Read each region of the copy into its target (of the region's length,
        :func:`read_regions`); the regions whose bytes did not match their CRC32C (none
        without ``check``: the copy was checked a moment ago)."""
        at = [(r.segment, r.offset, target) for r, target in reads]
        crcs = read_regions(self.fds, at, check)
        return [r for (r, _), crc in zip(reads, crcs, strict=True) if check and crc != r.crc32c]

    def verify(self, skip: Collection[HeldRegion] = ()) -> str | None:
        """None if the state and every region (but those in ``skip``, checked already)
        match their CRC32C; else what does not."""
        problem = self.state_problem()
        if problem is not None:
            return problem
        regions = [r for r in self.held.regions if r not in skip]
        if len(regions) == len(self.held.regions):
            self.populate()
        region = damaged_region(self.maps, regions)
        return None if region is None else self.damage(region)

    def populate(self) -> None:
        """Fault every mapped page in now, for reading the whole copy through the maps."""
        for mapped in self.maps:
            _populate_for_reading(mapped)

    def damage(self, region: HeldRegion) -> str:
        return (
            f"{self.slot}/segment-{region.segment} does not match its CRC32C at "
            f"bytes {region.offset}..{region.offset + region.nbytes}"
        )

    def close(self) -> None:
        maps, self.maps = self.maps, []
        for mapped in maps:
            with contextlib.suppress(BufferError):  # a tensor still views it: freed with it
                mapped.close()
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


def _map(fd: int, path: Path, size: int) -> mmap.mmap:
    if os.fstat(fd).st_size < size:
        raise ValueError(f"{path} is shorter than its descriptor says")
    return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


# Linux 5.14's MADV_POPULATE_READ (the mmap module names it from Python 3.13 on).
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def _populate_for_reading(mapped: mmap.mmap) -> None:
    """Fault the pages in at once for reading: one call instead of a fault per 4 KiB.

    Not MAP_POPULATE: on a private writable mapping it faults for writing, so the kernel
    would copy every page of the copy (its time, and as much memory again) before a byte
    is read. Older kernels refuse the advice; their pages then fault in as they are read."""
    if len(mapped):
        with contextlib.suppress(OSError):
            mapped.madvise(_POPULATE_READ)
