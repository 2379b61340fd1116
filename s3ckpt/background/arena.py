"""``StagingArena``: host memory shared with the checkpoint process, kept from save to save.

A save's state is copied into a few large anonymous shared-memory segments
(``memfd_create``), not into one allocation per tensor: the trainer and the checkpoint
process map each segment once, and a steady-state save allocates, maps, pins and sends
nothing but a small description of where each tensor lies. The segments have no name in
any file system, so nothing is left behind when either process ends, however it ends: the
kernel frees a segment when its last mapping and descriptor are gone.

Each save lays its storages out from the arena's first byte. The same state in the same
order (a training loop's) gets the same regions each time; a state that outgrows the
arena gets one more segment, sized for what did not fit.

An arena given a ``root`` folder (the memory tier's slots, :mod:`s3ckpt.tier`) keeps its
segments as files there instead (``segment-<i>`` in a tmpfs such as ``/dev/shm``), so
that the copy outlives the process that made it. Their pages are reserved with
``posix_fallocate`` when a segment is made: a tmpfs without room fails there with
:class:`~s3ckpt.errors.MemoryTierError`, instead of a SIGBUS at the first copy into a
page it cannot back.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from s3ckpt.dcp.compat import pin_host_memory, unpin_host_memory
from s3ckpt.errors import MemoryTierError

ALIGN = 4096  # page-aligned regions: copies and socket sends start on a page
_MIN_SEGMENT = 64 * 1024 * 1024


@dataclass(frozen=True)
class Region:
    """Where one staged storage lies: a segment's index, a byte offset and a length."""

    segment: int
    offset: int
    nbytes: int


class Segment:
    """One shared-memory segment, mapped in this process."""

    def __init__(
        self, size: int, *, fd: int | None = None, pin: bool = False, path: Path | None = None
    ) -> None:
        if fd is not None:
            self.fd = fd
        elif path is not None:
            self.fd = reserved_file(path, size)
        else:
            self.fd = os.memfd_create("s3ckpt-staging", os.MFD_CLOEXEC)
        try:
            if fd is None and path is None:
                os.ftruncate(self.fd, size)
            self.size = size
            # A new segment's pages are faulted in at once (MAP_POPULATE), quicker than one
            # page at a time during the first copy (docs/decisions/0007-staging-arena.md).
            populate = mmap.MAP_POPULATE if fd is None else 0
            self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | populate)
            self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        except BaseException:
            os.close(self.fd)
            raise
        self.pinned = pin and pin_host_memory(self.bytes)

    @property
    def mapping(self) -> mmap.mmap:
        """The segment's mapping in this process."""
        return self._map

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the segment from ``offset``, as a uint8 tensor whose storage is
        exactly those bytes (a slice of :attr:`bytes` would share the whole segment's)."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset)

    def close(self) -> None:
        if self.pinned:
            unpin_host_memory(self.bytes)
        del self.bytes
        # BufferError: a tensor still views it; the kernel frees it along with that tensor
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self.fd)


class StagingArena:
    """The segments of one trainer (or their mappings in its checkpoint process)."""

    def __init__(
        self, *, pin: bool = False, root: Path | None = None, limit: int | None = None
    ) -> None:
        self.segments: list[Segment] = []
        self._views: dict[Region, torch.Tensor] = {}  # the last copy's regions, as tensors
        self._pin = pin
        self.root = root
        self.limit = limit  # the most bytes one copy may take (a memory tier's max_bytes)

    @property
    def nbytes(self) -> int:
        """Host memory held, in bytes."""
        return sum(segment.size for segment in self.segments)

    @property
    def mappings(self) -> list[mmap.mmap]:
        """Each segment's mapping in this process, in order (what staged state unpickles over)."""
        return [segment.mapping for segment in self.segments]

    def allocate(self, sizes: list[int]) -> tuple[list[Region], list[Segment]]:
        """Regions for storages of ``sizes`` bytes, in order, from the arena's first byte
        (the previous save's copy is no longer needed); and the segments added for them.

        The same sizes get the same regions as last time, so the checkpoint process's
        mappings stay valid; what does not fit in the segments there are goes into one
        new segment, sized for all of it.
        """
        total = sum(sizes)
        if self.limit is not None and total > self.limit:
            raise MemoryTierError(
                f"the state takes {total} bytes, more than the memory tier's max_bytes "
                f"({self.limit}): nothing of it was copied"
            )
        regions: list[Region] = []
        added: list[Segment] = []
        index, offset = 0, 0
        for position, nbytes in enumerate(sizes):
            while index < len(self.segments) and offset + nbytes > self.segments[index].size:
                index, offset = index + 1, 0
            if index == len(self.segments):  # sized for all the rest: they all fit in it
                rest = sum(_round_up(n) for n in sizes[position:])
                path = None if self.root is None else self.root / f"segment-{index}"
                if path is not None and index == 0:
                    self._remove_earlier_segments()
                added.append(Segment(max(rest, _MIN_SEGMENT), pin=self._pin, path=path))
                self.segments.append(added[-1])
            regions.append(Region(index, offset, nbytes))
            offset = _round_up(offset + nbytes)
        return regions, added

    def _remove_earlier_segments(self) -> None:
        """An earlier process's segment files in ``root`` (its copy was invalidated by the
        caller before this arena's first save there)."""
        assert self.root is not None
        for path in self.root.glob("segment-*"):
            path.unlink(missing_ok=True)

    def view(self, region: Region) -> torch.Tensor:
        return self.segments[region.segment].view(region.offset, region.nbytes)

    def views(self, regions: list[Region]) -> list[torch.Tensor]:
        """Each region as a uint8 tensor over exactly its bytes. A training loop's state
        gets the same regions every save: their tensors are kept from the last call and
        handed out again, not made anew (a ``frombuffer`` each)."""
        kept, self._views = self._views, {}
        for region in regions:
            view = kept.get(region)
            self._views[region] = self.view(region) if view is None else view
        return [self._views[region] for region in regions]

    def locate(self, data_ptr: int, nbytes: int) -> Region | None:
        """The region of the arena a storage at ``data_ptr`` occupies, if it lies in one."""
        for index, segment in enumerate(self.segments):
            start = segment.bytes.data_ptr()
            if start <= data_ptr and data_ptr + nbytes <= start + segment.size:
                return Region(index, data_ptr - start, nbytes)
        return None

    def adopt(self, fd: int, size: int) -> None:
        """Map a segment another process created (the checkpoint process's side)."""
        self.segments.append(Segment(size, fd=fd))

    def close(self) -> None:
        segments, self.segments = self.segments, []
        self._views = {}  # views hold the mappings open
        for segment in segments:
            segment.close()


def reserved_file(path: Path, size: int, *, reuse: bool = False) -> int:
    """A new file of ``size`` bytes at ``path``, its pages reserved; its descriptor
    (:class:`~s3ckpt.errors.MemoryTierError` when the file system has no room).

    With ``reuse``, a file already there is kept, with the pages it has (memory written
    again costs no new pages to zero and fault in), grown to ``size`` if it is smaller and
    never shrunk: a staging arena may have the same file mapped at its own size."""
    exclusive = 0 if reuse else os.O_EXCL
    fd = os.open(path, os.O_RDWR | os.O_CREAT | exclusive | os.O_CLOEXEC, 0o600)
    try:
        reserve_range(fd, path, 0, size)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return fd


def reserve_range(fd: int, path: Path, offset: int, length: int) -> None:
    """Reserve the pages of ``length`` bytes from ``offset`` of the file at ``fd``: a full
    tmpfs is then this clear error, never a SIGBUS when the memory is written."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        free = shutil.disk_usage(path.parent).free
        raise MemoryTierError(
            f"not enough shared memory for the memory tier at {path.parent}: "
            f"{length} bytes could not be reserved ({exc.strerror}; {free} bytes free there)"
        ) from exc


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
