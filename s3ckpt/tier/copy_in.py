"""Copying a held copy into the model, checked as its bytes land.

A restore from memory must copy each tensor from the node's shared memory into the
model and check it against its CRC32C, as every S3 read is checked. A check pass over the
mapped copy and then a copy out of it would cost populating the mapping's page tables, a
CRC pass and a copy. Here each tensor whose bytes are one region of the copy is read from
the segment file straight into its target (``preadv``: the kernel copies from the tmpfs
pages, no source mapping to populate) and checksummed in 4 MiB steps right after, while
the bytes are in the cache, on several threads (``s3ckpt.background.held.read_regions``;
docs/decisions/0009-memory-tier-restore-copy-in.md).

What cannot be read that way (a target of another dtype or layout, a slice of a region)
is copied from the mapping, and the regions not read whole are checked through the
mapping after the load (:meth:`CheckedCopyIn.problem`).

A copy a restore receives from a peer (its node was lost) is loaded by
:class:`ReceivingCopyIn` as it arrives: each large region the model takes as it is lands
in its target straight from the socket, the rest in memory the load then copies from
(:class:`~s3ckpt.background.replicate.ReceiveIntoModel`).
"""

from __future__ import annotations

import bisect
import ctypes
from collections import Counter
from collections.abc import Sequence

import torch

from s3ckpt.background.held import HeldRegion, MappedCopy, damaged_region
from s3ckpt.background.replicate import ReceiveIntoModel, is_large
from s3ckpt.dcp.compat import has_lazy_bits
from s3ckpt.dcp.restore import as_bytes_tensor, takes_stored_bytes
from s3ckpt.dcp.tensor_bytes import tensor_view


class CheckedCopyIn:
    """A :data:`~s3ckpt.dcp.state_reader.CopyIn` for a held copy: reads what it can
    straight from the copy's files, each region's CRC32C checked as it lands (not with
    ``check=False``: for a copy checked as it arrived from a peer a moment ago).

    ``whole``: :meth:`problem` also checks the regions the load did not touch (a rank
    loading its own copy reads nearly all of it anyway); without it only those the load
    read from (a resharding load takes a part of each of several copies)."""

    def __init__(self, copy: MappedCopy, check: bool = True, whole: bool = True) -> None:
        self.copy, self._check, self._whole = copy, check, whole
        self._bases = [(_address(mapped), len(mapped)) for mapped in copy.maps]
        self._regions = {(r.segment, r.offset, r.nbytes): r for r in copy.held.regions}
        self._by_segment = _regions_by_segment(copy.held.regions)
        self.checked: set[HeldRegion] = set()
        self.touched: set[HeldRegion] = set()
        self.damaged: list[HeldRegion] = []

    def __call__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        reads = []
        for source, target in pairs:
            region = self._region_of(source, target)
            if region is None:
                target.copy_(source)  # faults the mapping's pages in as it reads
                if not self._whole:
                    self.touched.update(self._regions_under(source))
            else:
                reads.append((region, tensor_view(target)))
        self.damaged += self.copy.read_checked(reads, self._check)
        self.checked.update(region for region, _ in reads)

    def problem(self) -> str | None:
        """What did not match its CRC32C: among the regions read here, else among those
        the load did not read whole (checked now, through the mapping); None if all did."""
        if self.damaged:
            return self.copy.damage(self.damaged[0])
        if not self._check:
            return None
        if self._whole:
            return self.copy.verify(skip=self.checked)
        region = damaged_region(self.copy.maps, sorted(self.touched - self.checked, key=_place))
        return None if region is None else self.copy.damage(region)

    def _region_of(self, source: torch.Tensor, target: torch.Tensor) -> HeldRegion | None:
        return _exact_region(self._bases, self._regions, source, target)

    def _regions_under(self, source: torch.Tensor) -> list[HeldRegion]:
        """The copy's regions that ``source``'s bytes (a view into its maps) overlap."""
        if source.numel() == 0:
            return []
        start = source.data_ptr()
        span = sum(
            (size - 1) * stride for size, stride in zip(source.shape, source.stride(), strict=True)
        )
        end = start + (span + 1) * source.element_size()
        for segment, (base, size) in enumerate(self._bases):
            if base <= start < base + size:
                offsets, regions = self._by_segment.get(segment, ([], []))
                first = max(bisect.bisect_right(offsets, start - base) - 1, 0)
                last = bisect.bisect_left(offsets, end - base)
                return [r for r in regions[first:last] if r.offset + r.nbytes > start - base]
        return []


class ReceivingCopyIn:
    """A :data:`~s3ckpt.dcp.state_reader.CopyIn` for a copy arriving from a peer
    (:class:`~s3ckpt.background.replicate.ReceiveIntoModel`, whose maps the load's sources lie
    over): the large regions the model takes as they are land in their targets, the rest
    is copied from where it landed; :meth:`problem` after the load."""

    def __init__(self, fetched: ReceiveIntoModel) -> None:
        self.fetched = fetched
        self._bases = [(_address(mapped), len(mapped)) for mapped in fetched.maps]
        self._regions = {(r.segment, r.offset, r.nbytes): r for r in fetched.sent.regions}
        self._index = {r: index for index, r in enumerate(fetched.sent.regions)}
        self.received = False

    def __call__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        found = [(_exact_region(self._bases, self._regions, s, t), s, t) for s, t in pairs]
        uses = Counter(region for region, _, _ in found if region is not None)
        into, later = {}, []
        for region, source, target in found:
            if region is not None and uses[region] == 1 and is_large(region):
                into[self._index[region]] = as_bytes_tensor(target)
            else:
                later.append((source, target))
        self.received = True
        self.fetched.receive(into)
        for source, target in later:
            target.copy_(source)

    def problem(self) -> str | None:
        """What arrived damaged, if anything; a load that read no tensor (DCP never asked)
        still receives the copy here, so that it is checked whole."""
        if not self.received:
            self([])
        return self.fetched.check()


def _exact_region(
    bases: Sequence[tuple[int, int]],
    regions: dict[tuple[int, int, int], HeldRegion],
    source: torch.Tensor,
    target: torch.Tensor,
) -> HeldRegion | None:
    """The copy's region that is exactly ``source``'s bytes, when they can be read as they
    are into ``target``'s memory."""
    nbytes = source.numel() * source.element_size()
    if (
        nbytes == 0
        or target.device.type != "cpu"
        or target.shape != source.shape
        or not source.is_contiguous()
        or has_lazy_bits(source)
        or not takes_stored_bytes(target, source.dtype, nbytes)
    ):
        return None
    address = source.data_ptr()
    for segment, (base, size) in enumerate(bases):
        if base <= address < base + size:
            return regions.get((segment, address - base, nbytes))
    return None


def _regions_by_segment(
    regions: Sequence[HeldRegion],
) -> dict[int, tuple[list[int], list[HeldRegion]]]:
    """Each segment's regions in offset order, and their offsets (for bisecting)."""
    found: dict[int, list[HeldRegion]] = {}
    for region in sorted(regions, key=_place):
        found.setdefault(region.segment, []).append(region)
    return {segment: ([r.offset for r in rs], rs) for segment, rs in found.items()}


def _place(region: HeldRegion) -> tuple[int, int]:
    return region.segment, region.offset


def _address(mapped: object) -> int:
    """The address of a writable mapping's first byte."""
    if not len(mapped):  # type: ignore[arg-type]
        return 0
    first = ctypes.c_char.from_buffer(mapped)  # type: ignore[arg-type]
    try:
        return ctypes.addressof(first)
    finally:
        del first
