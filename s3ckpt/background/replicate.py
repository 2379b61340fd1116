"""Moving held copies between nodes: the checkpoint processes send each other their files.

Used twice by the memory tier: after a save is held, each rank's copy goes to its peers
on other nodes (replication, :class:`Exchange` in the save's hold), run by the checkpoint
processes on their own gloo group; at a restore, a rank whose node lost its copy receives
it back from a peer holding a replica, run by the trainers on a gloo group the memory
tier made for it (a restarted job's checkpoint processes may still be starting). Never
on the training loop's groups. Every process of the group takes part, even with nothing
to send:

1. each pair swaps a fixed-size header (the descriptor's length), then the descriptor
   and the staged state, with non-blocking sends and receives, so no order of pairs can
   deadlock;
2. each receiver reserves the segment files in the folder it was given (the caller
   emptied it), maps them, and receives the bytes straight into them: no buffer between
   the socket and the tmpfs;
3. each receiver checks every region against the sender's CRC32Cs, then writes the
   descriptor last, as a local save does (:mod:`s3ckpt.background.held`); a copy that
   arrives damaged is not recorded, and the exchange fails;
4. a barrier: when it returns, every copy of the exchange is recorded on its receiver.

Only the bytes the regions cover are sent (a segment is sized for growth), in pieces of
at most 256 MiB each.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from crc32c import crc32c

from s3ckpt.background import held
from s3ckpt.background.arena import reserved_file
from s3ckpt.errors import CorruptCheckpointError

_PIECE = 256 << 20


@dataclass(frozen=True)
class Exchange:
    """This process's part of one exchange: the copies it sends (to a rank, from a held
    copy's folder) and receives (from a rank, into an empty folder)."""

    sends: tuple[tuple[int, str], ...] = ()  # folder "": nothing to send (the copy failed)
    receives: tuple[tuple[int, str], ...] = ()


def exchange(plan: Exchange, group: dist.ProcessGroup | None = None) -> None:
    """Run this process's part of ``plan`` (peers are ranks of ``group``, default: the
    default group); every process of the group calls it."""
    nothing = [peer for peer, folder in plan.sends if not folder]
    outgoing = [(peer, _Outgoing(Path(folder))) for peer, folder in plan.sends if folder]
    try:
        headers = {peer: torch.tensor([len(out.meta)], dtype=torch.int64) for peer, out in outgoing}
        headers.update({peer: torch.tensor([-1], dtype=torch.int64) for peer in nothing})
        sizes = {peer: torch.zeros(1, dtype=torch.int64) for peer, _ in plan.receives}
        _wait(
            [dist.isend(header, group=group, group_dst=peer) for peer, header in headers.items()]
            + [dist.irecv(sizes[peer], group=group, group_src=peer) for peer, _ in plan.receives]
        )
        missing = [peer for peer in sizes if int(sizes[peer]) < 0]
        metas = {peer: bytearray(int(sizes[peer])) for peer in sizes if peer not in missing}
        _wait(
            [dist.isend(_bytes(out.meta), group=group, group_dst=peer) for peer, out in outgoing]
            + [
                dist.irecv(_bytes(metas[peer]), group=group, group_src=peer)
                for peer, _ in plan.receives
            ]
        )
        incoming = [
            (peer, _Incoming(Path(folder), bytes(metas[peer])))
            for peer, folder in plan.receives
            if peer in metas
        ]
        try:
            sends = [
                dist.isend(piece, group=group, group_dst=peer)
                for peer, out in outgoing
                for piece in out.pieces()
            ]
            receives = [
                dist.irecv(piece, group=group, group_src=peer)
                for peer, inc in incoming
                for piece in inc.pieces()
            ]
            _wait(sends + receives)
            for peer, inc in incoming:
                inc.record(peer)
        finally:
            for _, inc in incoming:
                inc.close()
    finally:
        for _, out in outgoing:
            out.close()
    dist.barrier(group=group)
    if missing:
        raise CorruptCheckpointError(
            f"rank(s) {missing} had no copy to send (their save failed before it was held)"
        )


def _bytes(buffer: bytearray) -> torch.Tensor:
    return torch.frombuffer(buffer, dtype=torch.uint8)


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _extents(record: held.Held) -> list[int]:
    """How many bytes of each segment the copy's regions cover (what is sent)."""
    used = [0] * len(record.segments)
    for region in record.regions:
        used[region.segment] = max(used[region.segment], region.offset + region.nbytes)
    return used


class _Outgoing:
    """A held copy being sent: its descriptor and state, and its segments' used bytes."""

    def __init__(self, folder: Path) -> None:
        record = held.read(folder)
        if record is None:
            raise CorruptCheckpointError(f"{folder} holds no complete copy to send")
        self.copy = held.MappedCopy(folder, record)
        self.copy.populate()  # all of it is sent
        self.meta = _pack(record.to_json().encode(), self.copy.state)

    def pieces(self) -> list[torch.Tensor]:
        out = []
        for mapped, used in zip(self.copy.maps, _extents(self.copy.held), strict=True):
            whole = torch.frombuffer(mapped, dtype=torch.uint8, count=used) if used else None
            out += [] if whole is None else list(whole.split(_PIECE))
        return out

    def close(self) -> None:
        self.copy.close()


class _Incoming:
    """A copy being received into ``folder``: its files reserved and mapped."""

    def __init__(self, folder: Path, meta: bytes) -> None:
        descriptor, self.state = _unpack(meta)
        self.sent = held.Held.from_json(descriptor.decode())
        self.folder = folder
        self.maps: list[mmap.mmap] = []
        held.invalidate(folder)
        used = _extents(self.sent)
        for path in folder.glob("segment-*"):
            index = path.name.removeprefix("segment-")
            if not index.isdigit() or int(index) >= len(used):
                path.unlink()
        for index, size in enumerate(used):
            # the slot's earlier segment files are reused (their pages kept, never shrunk);
            # mapped without MAP_POPULATE: pages fault in as the bytes arrive, beside the
            # sender's work
            fd = reserved_file(folder / f"segment-{index}", max(size, 1), reuse=True)
            try:
                self.maps.append(mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED))
            finally:
                os.close(fd)
        self.used = used

    def pieces(self) -> list[torch.Tensor]:
        out = []
        for mapped, used in zip(self.maps, self.used, strict=True):
            if used:
                out += list(torch.frombuffer(mapped, dtype=torch.uint8, count=used).split(_PIECE))
        return out

    def record(self, peer: int) -> None:
        """Check the bytes against the sender's CRC32Cs; then write the descriptor."""
        region = held.damaged_region(self.maps, self.sent.regions)
        if region is not None:
            raise CorruptCheckpointError(
                f"the copy of rank {self.sent.rank}'s step {self.sent.step} from "
                f"rank {peer} arrived damaged (segment {region.segment}, bytes "
                f"{region.offset}..{region.offset + region.nbytes})"
            )
        if crc32c(self.state) != self.sent.state_crc32c:
            raise CorruptCheckpointError(f"the state of the copy from rank {peer} arrived damaged")
        record = dataclasses.replace(self.sent, segments=tuple(max(u, 1) for u in self.used))
        held.write(self.folder, record, self.state)

    def close(self) -> None:
        maps, self.maps = self.maps, []
        for mapped in maps:
            mapped.close()


def _pack(descriptor: bytes, state: bytes) -> bytearray:
    return bytearray(len(descriptor).to_bytes(8, "little") + descriptor + state)


def _unpack(meta: bytes) -> tuple[bytes, bytes]:
    length = int.from_bytes(meta[:8], "little")
    return meta[8 : 8 + length], meta[8 + length :]
