"""Moving held copies between nodes: the checkpoint processes send each other their files.

Used twice by the memory tier: after a save is held, each rank's copy goes to its peers
on other nodes (replication, :class:`ReplicaExchange` in the save's hold), run by the checkpoint
processes on their own gloo group; at a restore, a rank whose node lost its copy receives
it back from a peer holding a replica, run by the trainers on a gloo group the memory
tier made for it (a restarted job's checkpoint processes may still be starting). Never
on the training loop's groups. Every process of the group takes part, even with nothing
to send:

1. each pair swaps a fixed-size header (the descriptor's length), then the descriptor
   and the staged state, with non-blocking sends and receives, so no order of pairs can
   deadlock;
2. each receiver reserves the segment files in the folder it was given (the caller
   emptied it; no room is a clear error, never a SIGBUS), maps them, and tells its sender
   whether to send; then receives the bytes straight into them: no buffer between the
   socket and the tmpfs;
3. each receiver checks every region against the sender's CRC32Cs as its pieces land
   (the check of one piece overlaps the transfer of the next), then writes the
   descriptor last, as a local save does (:mod:`s3ckpt.background.held`); a copy that
   arrives damaged is not recorded, and the exchange fails;
4. a barrier, which every process reaches, a failed receiver too (its error is raised
   after it): when it returns, every copy received intact is recorded on its receiver.

Only the bytes of the regions are sent (a segment is sized for growth), in pieces of at
most 32 MiB that never straddle a large region's edge (small regions travel together);
both sides cut them the same way from the descriptor.

A restore may instead receive a copy straight into the model (:class:`ReceiveIntoModel`, for the
rank receiving it; its sender runs :func:`exchange` as for any copy): each piece of a
large region lands in the tensor that region is loaded into, the rest in anonymous
memory the load copies from, each region checked as it lands. No segment files are
reserved and no second copy is made, which saves reserving tmpfs pages and loading from
them (docs/decisions/0009-memory-tier-restore-copy-in.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from crc32c import crc32c

from s3ckpt.background import held
from s3ckpt.background.arena import reserved_file
from s3ckpt.dcp.tensor_bytes import tensor_view
from s3ckpt.errors import CorruptCheckpointError

_PIECE = 32 << 20  # bytes per send and receive: received and checked in turn
_LARGE = 1 << 20  # regions from this size are sent on their own (a restore receives them in place)


@dataclass(frozen=True)
class ReplicaExchange:
    """This process's part of one exchange: the copies it sends (to a rank, from a held
    copy's folder) and receives (from a rank, into an empty folder)."""

    sends: tuple[tuple[int, str], ...] = ()  # folder "": nothing to send (the copy failed)
    receives: tuple[tuple[int, str], ...] = ()


def exchange(plan: ReplicaExchange, group: dist.ProcessGroup | None = None) -> None:
    """Run this process's part of ``plan`` (peers are ranks of ``group``, default: the
    default group); every process of the group calls it. A copy that cannot be received
    (no room, damaged on the way) fails on its receiver after every process has met at
    the closing barrier, so no peer is left waiting."""
    nothing = [peer for peer, folder in plan.sends if not folder]
    outgoing = [(peer, _Outgoing(Path(folder))) for peer, folder in plan.sends if folder]
    incoming: list[tuple[int, _Incoming]] = []
    failures: list[Exception] = []
    try:
        headers = {peer: torch.tensor([len(out.meta)], dtype=torch.int64) for peer, out in outgoing}
        headers.update({peer: torch.tensor([-1], dtype=torch.int64) for peer in nothing})
        sizes = {peer: torch.zeros(1, dtype=torch.int64) for peer, _ in plan.receives}
        _swap(headers, sizes, group)
        missing = [peer for peer in sizes if int(sizes[peer]) < 0]
        if missing:
            failures.append(
                CorruptCheckpointError(
                    f"rank(s) {missing} had no copy to send (their save failed before it was held)"
                )
            )
        metas = {peer: bytearray(int(sizes[peer])) for peer in sizes if peer not in missing}
        _swap(
            {peer: _bytes(out.meta) for peer, out in outgoing},
            {peer: _bytes(meta) for peer, meta in metas.items()},
            group,
        )
        for peer, folder in plan.receives:
            if peer in metas:
                try:
                    incoming.append((peer, _Incoming(Path(folder), bytes(metas[peer]))))
                except Exception as exc:  # no room, an unusable folder: no sending to it
                    failures.append(exc)
        # each receiver tells its sender whether to send: a receiver without room for
        # the copy would otherwise leave the sender's pieces unmatched
        ready = {peer: torch.tensor([1], dtype=torch.int64) for peer, _ in incoming}
        ready.update(
            {peer: torch.tensor([0], dtype=torch.int64) for peer in metas if peer not in ready}
        )
        answers = {peer: torch.zeros(1, dtype=torch.int64) for peer, _ in outgoing}
        _swap(ready, answers, group)
        sends = [
            dist.isend(piece, group=group, group_dst=peer)
            for peer, out in outgoing
            if int(answers[peer])
            for piece in out.pieces()
        ]
        for peer, inc in incoming:
            inc.receive(peer, group)
        _wait(sends)
        for peer, inc in incoming:
            try:
                inc.record(peer)
            except CorruptCheckpointError as exc:
                failures.append(exc)
    finally:
        for _, inc in incoming:
            inc.close()
        for _, out in outgoing:
            out.close()
    dist.barrier(group=group)
    if failures:
        raise failures[0]


def _swap(sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor], group: Any) -> None:
    """Send each ``sends[peer]`` and receive each ``receives[peer]``, all at once (no
    order of pairs can deadlock)."""
    _wait(
        [dist.isend(tensor, group=group, group_dst=peer) for peer, tensor in sends.items()]
        + [dist.irecv(tensor, group=group, group_src=peer) for peer, tensor in receives.items()]
    )


def _bytes(buffer: bytearray) -> torch.Tensor:
    return torch.frombuffer(buffer, dtype=torch.uint8)


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _extents(record: held.HeldRecord) -> list[int]:
    """How many bytes of each segment the copy's regions cover (what is sent)."""
    used = [0] * len(record.segments)
    for region in record.regions:
        used[region.segment] = max(used[region.segment], region.offset + region.nbytes)
    return used


def _pieces(record: held.HeldRecord) -> list[tuple[int, int, int]]:
    """The ``(segment, start, length)`` pieces a copy is sent in, in order: the same on
    both sides, cut from the descriptor. A large region's pieces hold its bytes alone
    (so they can land in its target); runs of small regions go together, with the few
    bytes between them, up to a piece's size."""
    pieces: list[tuple[int, int, int]] = []
    for segment in range(len(record.segments)):
        regions = sorted(
            (r for r in record.regions if r.segment == segment and r.nbytes),
            key=lambda r: r.offset,
        )
        start = end = -1
        for region in regions:
            region_end = region.offset + region.nbytes
            large = region.nbytes >= _LARGE
            if start >= 0 and (large or region_end - start > _PIECE):
                pieces.append((segment, start, end - start))
                start = -1
            if large:
                pieces.extend(
                    (segment, at, min(_PIECE, region_end - at))
                    for at in range(region.offset, region_end, _PIECE)
                )
                continue
            if start < 0:
                start = region.offset
            end = region_end
        if start >= 0:
            pieces.append((segment, start, end - start))
    return pieces


def is_large(region: held.HeldRegion) -> bool:
    """Whether ``region`` is sent in pieces of its own (receivable in place)."""
    return region.nbytes >= _LARGE


class _Outgoing:
    """A held copy being sent: its descriptor and state, and its segments' used bytes."""

    def __init__(self, folder: Path) -> None:
        record = held.read(folder)
        if record is None:
            raise CorruptCheckpointError(f"{folder} holds no complete copy to send")
        self.copy = held.MappedCopy(folder, record)
        self.meta = _pack(record.to_json().encode(), self.copy.state)

    def pieces(self) -> list[torch.Tensor]:
        self.copy.populate()  # all of it is sent: after the headers, beside the receiver's setup
        return [
            torch.frombuffer(self.copy.maps[segment], dtype=torch.uint8, count=length, offset=start)
            for segment, start, length in _pieces(self.copy.held)
        ]

    def close(self) -> None:
        self.copy.close()


class _Receiving:
    """A copy's pieces being received, each region's CRC32C carried over its bytes as
    they land, where they land: in :attr:`maps`, or in the tensor a restore loads the
    region into."""

    sent: held.HeldRecord
    state: bytes
    maps: list[mmap.mmap]
    crcs: list[int]

    def _receive_pieces(
        self,
        peer: int,
        group: dist.ProcessGroup | None,
        into: dict[int, torch.Tensor],
        ready: Callable[[], None] | None = None,
    ) -> None:
        """Receive every piece from ``peer`` (each region in ``into``, by index, lands in
        that flat byte tensor; the rest in :attr:`maps`): every receive posted ahead,
        then each piece checked as it lands, while the next ones arrive. ``ready`` is
        called once every piece's place is known, before the first receive is posted
        (what tells the sender to send: nothing can fail between it and the receives)."""
        by_start = {
            (r.segment, r.offset): index
            for index, r in enumerate(self.sent.regions)
            if index in into and is_large(r)
        }
        places = []
        owner: int | None = None  # the region in ``into`` the pieces fall in
        for segment, start, length in _pieces(self.sent):
            owner = by_start.get((segment, start), owner)
            if owner is not None:
                region = self.sent.regions[owner]
                if not (region.segment == segment and start < region.offset + region.nbytes):
                    owner = None  # past its end: a piece of small regions, or of another
            if owner is not None:
                at = start - self.sent.regions[owner].offset
                target = into[owner][at : at + length]
            else:
                target = torch.frombuffer(
                    self.maps[segment], dtype=torch.uint8, count=length, offset=start
                )
            places.append((target, segment, start, length))
        if ready is not None:
            ready()
        works = [
            (dist.irecv(target, group=group, group_src=peer), segment, start, length)
            for target, segment, start, length in places
        ]
        self._landed_in = into
        # regions in the order the pieces come (they do not overlap one another)
        order = sorted(range(len(self.sent.regions)), key=lambda i: self._at(i))
        first = 0
        for work, segment, start, length in works:
            work.wait()
            while first < len(order) and self._end(order[first]) <= (segment, start):
                first += 1  # wholly in earlier pieces
            for index in order[first:]:
                if self._at(index) >= (segment, start + length):
                    break
                self._carry(index, start, start + length)

    def _at(self, index: int) -> tuple[int, int]:
        region = self.sent.regions[index]
        return region.segment, region.offset

    def _end(self, index: int) -> tuple[int, int]:
        region = self.sent.regions[index]
        return region.segment, region.offset + region.nbytes

    def _carry(self, index: int, start: int, end: int) -> None:
        """Carry region ``index``'s CRC32C over its bytes in ``[start, end)``."""
        region = self.sent.regions[index]
        low, high = max(start, region.offset), min(end, region.offset + region.nbytes)
        if low >= high:
            return
        target = self._landed_in.get(index)
        if target is not None:
            view = tensor_view(target[low - region.offset : high - region.offset])
            self.crcs[index] = crc32c(view, self.crcs[index])
            return
        with memoryview(self.maps[region.segment])[low:high] as view:
            self.crcs[index] = crc32c(view, self.crcs[index])

    def _check(self, peer: int) -> None:
        """Raise :class:`~s3ckpt.errors.CorruptCheckpointError` unless every region
        matched its CRC32C."""
        for region, crc in zip(self.sent.regions, self.crcs, strict=True):
            if crc != region.crc32c:
                raise CorruptCheckpointError(
                    f"the copy of rank {self.sent.rank}'s step {self.sent.step} from "
                    f"rank {peer} arrived damaged (segment {region.segment}, bytes "
                    f"{region.offset}..{region.offset + region.nbytes})"
                )


class _Incoming(_Receiving):
    """A copy being received into ``folder``: its files reserved and mapped (no room is a
    :class:`~s3ckpt.errors.MemoryTierError` before a byte is sent), each piece checked as
    it lands."""

    def __init__(self, folder: Path, meta: bytes) -> None:
        descriptor, self.state = _unpack(meta)
        self.sent = held.HeldRecord.from_json(descriptor.decode())
        self.folder = folder
        self.maps: list[mmap.mmap] = []
        self.fds: list[int] = []
        held.invalidate(folder)
        used = _extents(self.sent)
        for path in folder.glob("segment-*"):
            index = path.name.removeprefix("segment-")
            if not index.isdigit() or int(index) >= len(used):
                path.unlink()
        try:
            for index, size in enumerate(used):
                # the slot's earlier segment files are reused (their pages kept, never
                # shrunk); mapped without MAP_POPULATE: pages fault in as the bytes arrive
                path = folder / f"segment-{index}"
                self.fds.append(reserved_file(path, max(size, 1), reuse=True))
                self.maps.append(mmap.mmap(self.fds[-1], max(size, 1), flags=mmap.MAP_SHARED))
        except BaseException:
            self.close()
            raise
        self.used = used
        self.crcs = [held.EMPTY_CRC] * len(self.sent.regions)

    def receive(self, peer: int, group: dist.ProcessGroup | None) -> None:
        """Receive the copy from ``peer`` into the mapped files."""
        self._receive_pieces(peer, group, {})

    def record(self, peer: int) -> None:
        """Check the CRC32Cs carried over the pieces; then write the descriptor."""
        self._check(peer)
        if crc32c(self.state) != self.sent.state_crc32c:
            raise CorruptCheckpointError(f"the state of the copy from rank {peer} arrived damaged")
        record = dataclasses.replace(self.sent, segments=tuple(max(u, 1) for u in self.used))
        held.write(self.folder, record, self.state)

    def close(self) -> None:
        maps, self.maps = self.maps, []
        for mapped in maps:
            mapped.close()
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


class ReceiveIntoModel(_Receiving):
    """A restore's copy received from ``peer`` straight into the model, for a rank with
    nothing to send in the same exchange; ``peer`` runs :func:`exchange` with this rank
    among its sends, every other process of ``group`` runs it too.

    Constructed before the load: the descriptor and the staged state arrive (the state's
    tensors lie over :attr:`maps`, anonymous memory whose pages are touched only where
    bytes land in it). The load then calls :meth:`receive` with the regions it can take
    in place; :meth:`finish`, after the load whatever happened, tells a sender never
    answered not to send and meets every process at the exchange's closing barrier.
    """

    def __init__(self, peer: int, group: dist.ProcessGroup | None) -> None:
        self.peer, self.group = peer, group
        self._answered = False
        self.maps = []
        self.crcs = []
        self._landed_in: dict[int, torch.Tensor] = {}
        self.problem: str | None = None  # set when the copy cannot be loaded: do not receive
        size = torch.zeros(1, dtype=torch.int64)
        _swap({}, {peer: size}, group)
        if int(size) < 0:
            self._answered = True  # the sender sends nothing more
            self.problem = f"rank {peer} had no copy to send (its save failed before it was held)"
            return
        meta = bytearray(int(size))
        _swap({}, {peer: _bytes(meta)}, group)
        descriptor, self.state = _unpack(bytes(meta))
        try:
            self.sent = held.HeldRecord.from_json(descriptor.decode())
        except (ValueError, TypeError, KeyError) as exc:
            self.problem = f"the descriptor of the copy from rank {peer} arrived damaged: {exc}"
            return
        if crc32c(self.state) != self.sent.state_crc32c:
            self.problem = f"the state of the copy from rank {peer} arrived damaged"
            return
        self.maps = [mmap.mmap(-1, max(size, 1)) for size in _extents(self.sent)]
        self.crcs = [held.EMPTY_CRC] * len(self.sent.regions)

    def receive(self, into: dict[int, torch.Tensor]) -> None:
        """Tell the sender to send, and receive: each large region indexed in ``into``
        lands in that flat byte tensor, the rest in :attr:`maps`; every region checked
        as it lands (:meth:`check`)."""
        self._receive_pieces(self.peer, self.group, into, ready=lambda: self._answer(True))

    def check(self) -> str | None:
        """What arrived damaged, if anything (after :meth:`receive`)."""
        if self.problem is not None:
            return self.problem
        if not self._answered:
            return f"the copy from rank {self.peer} was never received"
        try:
            self._check(self.peer)
        except CorruptCheckpointError as exc:
            return str(exc)
        return None

    def finish(self) -> None:
        """After the load, whatever happened: the sender told not to send if it never was
        answered, then the exchange's closing barrier."""
        try:
            if not self._answered:
                self._answer(False)
        finally:
            maps, self.maps = self.maps, []
            for mapped in maps:
                with contextlib.suppress(BufferError):  # a tensor still views it
                    mapped.close()
            dist.barrier(group=self.group)

    def _answer(self, ready: bool) -> None:
        self._answered = True
        _swap({self.peer: torch.tensor([int(ready)], dtype=torch.int64)}, {}, self.group)


def _pack(descriptor: bytes, state: bytes) -> bytearray:
    return bytearray(len(descriptor).to_bytes(8, "little") + descriptor + state)


def _unpack(meta: bytes) -> tuple[bytes, bytes]:
    length = int.from_bytes(meta[:8], "little")
    return meta[8 : 8 + length], meta[8 + length :]
