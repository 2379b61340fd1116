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
from dataclasses import asdict, dataclass
from pathlib import Path

from crc32c import crc32c

FORMAT = "s3ckpt-held/1"
DESCRIPTOR = "held.json"
STATE = "state.pkl"


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


def region_crcs(views: list[memoryview]) -> list[int]:
    """The CRC32C of each region's bytes (native code, without the GIL)."""
    return [crc32c(view) for view in views]


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
        for region in self.held.regions:
            view = memoryview(self.maps[region.segment])[
                region.offset : region.offset + region.nbytes
            ]
            try:
                if crc32c(view) != region.crc32c:
                    return (
                        f"{self.slot}/segment-{region.segment} does not match its CRC32C at "
                        f"bytes {region.offset}..{region.offset + region.nbytes}"
                    )
            finally:
                view.release()
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
        # populated at once: one call instead of a page fault per 4 KiB at the first read
        flags = mmap.MAP_PRIVATE | mmap.MAP_POPULATE
        return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
