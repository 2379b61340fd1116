"""Rank side of test_replica_exchange.py: one held copy sent from rank 0 to rank 1."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _dist_worker import _init
from crc32c import crc32c

from s3ckpt.background import held, replicate

# regions (segment, offset, nbytes): several pieces each, a piece shared by two regions,
# an empty one, a second segment
REGIONS = [(0, 0, 10_000), (0, 12_288, 2_500), (0, 16_384, 0), (1, 4_096, 9_000)]


def make_copy(slot: Path, seed: int) -> held.HeldRecord:
    """A held copy in ``slot`` with :data:`REGIONS` over random bytes."""
    g = torch.Generator().manual_seed(seed)
    segments = [torch.randint(0, 256, (32_768,), generator=g, dtype=torch.uint8) for _ in "ab"]
    data = [s.numpy().tobytes() for s in segments]
    for index, content in enumerate(data):
        (slot / f"segment-{index}").write_bytes(content)
    record = held.HeldRecord(
        step=3, rank=0, world=2, run="s3://b/r", segments=(32_768, 32_768),
        regions=tuple(
            held.HeldRegion(s, o, n, crc32c(data[s][o : o + n])) for s, o, n in REGIONS
        ),
        state_crc32c=crc32c(b"state"), nbytes=sum(n for _, _, n in REGIONS),
        created=time.time(),
    )  # fmt: skip
    held.write(slot, record, b"state")
    return record


def exchange_main(
    rank: int, world_size: int, port: int, sender: str, receiver: str, fault: str, out: str
) -> None:
    _init(rank, world_size, port)
    replicate._PIECE = 4_000  # many pieces per region, regions sharing pieces
    replicate._LARGE = 5_000  # regions 0 and 3 sent in pieces of their own, 1 and 2 together
    report: dict[str, object] = {}
    try:
        if rank == 0:
            make_copy(Path(sender), seed=1)
            at = {"damaged": (1, 4_096 + 8_999), "into damaged": (0, 5_000)}.get(fault)
            if at is not None:  # the sender's bytes changed after they were recorded
                segment, offset = at
                with open(Path(sender) / f"segment-{segment}", "r+b") as f:
                    f.seek(offset)
                    byte = f.read(1)[0]
                    f.seek(offset)
                    f.write(bytes([byte ^ 0x01]))
            plan = replicate.ReplicaExchange(sends=((1, sender),))
        elif fault.startswith("into"):
            report.update(_received_into_memory(fault))
            Path(out, f"rank{rank}.json").write_text(json.dumps(report))
            dist.destroy_process_group()
            return
        else:
            if fault == "no room":
                replicate.reserved_file = _no_room
            plan = replicate.ReplicaExchange(receives=((0, receiver),))
        replicate.exchange(plan)
        report["ok"] = True
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    if rank == 1:
        report["held"] = held.read(Path(receiver)) is not None
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _received_into_memory(fault: str) -> dict[str, object]:
    """Rank 1's side of a restore's fetch (:class:`replicate.ReceiveIntoModel`): region 0 received
    straight into a tensor of its own, the rest into anonymous memory; or (``into
    refused``) never asked for, so the sender must not send."""
    fetched = replicate.ReceiveIntoModel(0, None)
    report: dict[str, object] = {"problem": fetched.problem}
    try:
        if fault == "into refused":
            return report
        target = torch.zeros(10_000, dtype=torch.uint8)
        fetched.receive({0: target})
        report["check"] = fetched.check()
        report["in target"] = target.numpy().tobytes().hex()
        report["in memory"] = [bytes(fetched.maps[s][o : o + n]).hex() for s, o, n in REGIONS[1:]]
    finally:
        fetched.finish()
    return report


def _no_room(path: Path, size: int, **_: object) -> int:
    from s3ckpt.errors import MemoryTierError

    raise MemoryTierError(f"not enough shared memory for the memory tier at {path.parent}")
