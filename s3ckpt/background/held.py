"""A held copy: one rank's staged save, kept in shared memory as a memory-tier checkpoint.

A memory-tier slot is a folder (``<root>/<run>/rank-<r>/slot-<i>/``, see
:mod:`s3ckpt.tier.copies`) that holds, besides the staging arena's segment files
(``segment-<j>``):

* ``state.pkl``: the staged state, pickled with its arena tensors by reference
  (:func:`~s3ckpt.background.channel.dumps_staged`);
* ``held.json``: written last, by an atomic rename, once every byte of the copy is in
  place and checksummed: the step, the rank and the world size it belongs to, the run, and
  the CRC32C of every region of the segments and of ``state.pkl``.

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
from collections.abc import Sequence
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
_THREADS = 8


@dataclass(frozen=True)
class HeldRegion:
    """One staged storage's bytes in a segment file, and their CRC32C."""

    segment: int
    offset: int
    nbytes: int
    crc32c: int


@dataclass(frozen=True)
class Held:
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

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Held:
        fields = json.loads(text)
        if fields.pop("format", None) != FORMAT:
            raise ValueError(f"not a {FORMAT} descriptor")
        fields["segments"] = tuple(fields["segments"])
        fields["regions"] = tuple(HeldRegion(**region) for region in fields["regions"])
        return cls(**fields)


def region_crcs(maps: Sequence[Any], regions: Sequence[tuple[int, int, int]]) -> list[int]:
    """The CRC32C of each ``(segment, offset, nbytes)`` region of the segments ``maps``.

    The regions' bytes are cut into batches of about ``_PIECE`` bytes (a large region in
    several pieces, small ones many to a batch), checked on several threads (CRC32C runs
    in native code without the GIL), and each region's CRC combined from its pieces'
    (:func:`checksums.combine`): a copy is checked at the cores' speed however its
    tensors are sized, and a state of many small tensors costs one task per batch, not
    one per tensor."""
    batches: list[list[tuple[int, int, int, int]]] = [[]]
    filled = 0
    for index, (segment, offset, nbytes) in enumerate(regions):
        for start in range(offset, offset + nbytes, _PIECE):
            length = min(_PIECE, offset + nbytes - start)
            if filled + length > _PIECE and batches[-1]:
                batches.append([])
                filled = 0
            batches[-1].append((index, segment, start, length))
            filled += length

    def batch_crcs(batch: list[tuple[int, int, int, int]]) -> list[int]:
        crcs = []
        for _, segment, start, length in batch:
            with memoryview(maps[segment])[start : start + length] as view:
                crcs.append(crc32c(view))
        return crcs

    threads = min(len(batches), os.cpu_count() or 1, _THREADS)
    if threads > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="s3ckpt-crc") as pool:
            computed = list(pool.map(batch_crcs, batches))
    else:
        computed = [batch_crcs(batch) for batch in batches]
    found = [EMPTY_CRC] * len(regions)
    for batch, crcs in zip(batches, computed, strict=True):
        for (index, _, start, length), crc in zip(batch, crcs, strict=True):
            first = start == regions[index][1]
            found[index] = crc if first else checksums.combine(found[index], crc, length)
    return found


def damaged_region(maps: Sequence[Any], regions: Sequence[HeldRegion]) -> HeldRegion | None:
    """The first of ``regions`` whose bytes in ``maps`` do not match its CRC32C, if any."""
    crcs = region_crcs(maps, [(r.segment, r.offset, r.nbytes) for r in regions])
    return next((r for r, crc in zip(regions, crcs, strict=True) if crc != r.crc32c), None)


def write(slot: Path, held: Held, state: bytes) -> None:
    """Record a complete copy in ``slot``: its state, then its descriptor, atomically last."""
    (slot / STATE).write_bytes(state)
    temporary = slot / f"{DESCRIPTOR}.tmp"
    temporary.write_text(held.to_json())
    os.replace(temporary, slot / DESCRIPTOR)


def invalidate(slot: Path) -> None:
    """Make ``slot`` hold nothing (its descriptor first), before it is written again."""
    (slot / DESCRIPTOR).unlink(missing_ok=True)
    (slot / STATE).unlink(missing_ok=True)


def read(slot: Path) -> Held | None:
    """The descriptor of ``slot``, or None if it holds no complete copy (or an unreadable one)."""
    try:
        return Held.from_json((slot / DESCRIPTOR).read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None


class MappedCopy:
    """The files of a held copy mapped into this process (copy-on-write, never written
    back), to verify and read it."""

    def __init__(self, slot: Path, held: Held) -> None:
        self.slot, self.held = slot, held
        self.maps: list[mmap.mmap] = []
        try:
            for index, size in enumerate(held.segments):
                self.maps.append(_map(slot / f"segment-{index}", size))
            self.state = (slot / STATE).read_bytes()
        except BaseException:
            self.close()
            raise

    def verify(self) -> str | None:
        """None if every region and the state match their CRC32C; else what does not."""
        if crc32c(self.state) != self.held.state_crc32c:
            return f"{self.slot / STATE} does not match its CRC32C"
        region = damaged_region(self.maps, self.held.regions)
        if region is not None:
            return (
                f"{self.slot}/segment-{region.segment} does not match its CRC32C at "
                f"bytes {region.offset}..{region.offset + region.nbytes}"
            )
        return None

    def close(self) -> None:
        maps, self.maps = self.maps, []
        for mapped in maps:
            with contextlib.suppress(BufferError):  # a tensor still views it: freed with it
                mapped.close()


def _map(path: Path, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size < size:
            raise ValueError(f"{path} is shorter than its descriptor says")
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    _populate_for_reading(mapped)
    return mapped


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
