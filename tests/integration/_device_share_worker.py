"""Rank side of the tests of shared ranges carried in device memory (``dcp.shared_read``).

``forced_main`` runs on gloo CPU ranks with the decision forced: the group "carries device
tensors" for CPU destinations, and CPU destinations of 1 MiB or more pass through the
bounce slabs (as ``test_device_load.py`` routes them), so fetching into the destination or
a device buffer, sending from it, receiving into it and checking it back through the
slabs all run as they do for CUDA over NCCL. ``nccl_main`` runs the real thing, one GPU
per rank. Each rank records what it allocated and sent, and reports it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from _dist_worker import _init, _report

MiB = 1024 * 1024
BOUNCE = 16 * MiB
REQUEST = 8 * MiB


def raw_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(21)
    return {
        "w": torch.randn(6 * MiB, generator=g),  # 24 MiB: three pieces of one 8 MiB slab
        "t": torch.randn(2048, 1024, generator=g),  # loaded into a transposed view
        "bf16": torch.randn(1536, 1024, generator=g).to(torch.bfloat16),  # 3 MiB
        **{f"norm.{i}": torch.randn(64 + i, generator=g) for i in range(4)},  # own buffers
        "step": 7,  # bytes for the planner: host memory
    }


def zstd_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(22)
    return {"zeros": torch.zeros(2048, 2048), "w": torch.randn(MiB, generator=g)}


def tensor_bytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def targets_for(state: dict[str, Any], device: str) -> dict[str, Any]:
    targets: dict[str, Any] = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            targets[name] = 0
        elif name in ("t", "zeros"):  # non-contiguous: a device buffer, narrowed there
            rows, cols = value.shape
            targets[name] = torch.zeros(cols, rows, dtype=value.dtype, device=device).t()
        else:
            targets[name] = torch.zeros_like(value, device=device)
    return targets


def exact(targets: dict[str, Any], state: dict[str, Any]) -> dict[str, bool]:
    return {
        name: torch.equal(targets[name].cpu(), value)
        if isinstance(value, torch.Tensor)
        else targets[name] == value
        for name, value in state.items()
    }


class Recorder:
    """What a rank's loads allocate and transfer, counted by wrapping the functions."""

    def __init__(self) -> None:
        self.host_buffers: list[int] = []
        self.device_buffers: list[tuple[int, str]] = []
        self.checkouts: list[tuple[int, int, bool]] = []  # (slab size, count, pinned)
        self.most_held = 0
        self.sent: Counter[str] = Counter()  # bytes, by route ("device:cpu", "host:cpu")
        self.received: Counter[str] = Counter()
        self.sent_from_device: list[bool] = []  # every tensor of a device route on the device
        self.damage_sends = False

    def install(self) -> None:
        from s3ckpt.dcp import device_load, restore, shared_read

        byte_buffer, device_buffer = restore.byte_buffer, device_load.device_buffer
        checkout, take = device_load.checkout, device_load.Slabs.take
        transfers = shared_read.Routed.transfers

        def host(nbytes: int) -> torch.Tensor:
            self.host_buffers.append(nbytes)
            return byte_buffer(nbytes)

        def device(nbytes: int, where: torch.device) -> torch.Tensor:
            self.device_buffers.append((nbytes, where.type))
            return device_buffer(nbytes, where)

        def checked_out(size: int, budget: int, pinned: bool) -> device_load.Slabs:
            slabs = checkout(size, budget, pinned)
            self.checkouts.append((slabs.size, len(slabs.tensors), slabs.pinned))
            return slabs

        def taken(slabs: device_load.Slabs) -> int:
            slab = take(slabs)
            self.most_held = max(self.most_held, len(slabs.tensors) - len(slabs.free))
            return slab

        def recorded(routed: Any, rank: int, kept: Any) -> Any:
            sends, receives = transfers(routed, rank, kept)
            route = ":".join(routed.route)
            if routed.in_device and self.damage_sends:
                sends = [(_damaged(t), peer, tag) for t, peer, tag in sends]
            self.sent[route] += sum(t.numel() for t, _, _ in sends)
            self.received[route] += sum(t.numel() for t, _, _ in receives)
            if routed.in_device:
                device = routed.route[1]
                self.sent_from_device += [t.device.type == device for t, _, _ in sends + receives]
            return sends, receives

        restore.byte_buffer = host  # type: ignore[assignment]
        device_load.device_buffer = device  # type: ignore[assignment]
        device_load.checkout = checked_out  # type: ignore[assignment]
        device_load.Slabs.take = taken  # type: ignore[method-assign]
        shared_read.Routed.transfers = recorded  # type: ignore[method-assign]

    def report(self) -> dict[str, Any]:
        """What was counted since :meth:`clear`, copied (counting goes on)."""
        return {
            name: dict(value) if isinstance(value, Counter) else list(value)
            for name, value in vars(self).items()
            if isinstance(value, (list, Counter))
        } | {"most_held": self.most_held}

    def clear(self) -> None:
        damage = self.damage_sends
        self.__init__()  # type: ignore[misc]
        self.damage_sends = damage


def _damaged(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` with one byte flipped: damage between the owner's check and
    the receiver."""
    copy = tensor.clone()
    copy[copy.numel() // 2] ^= 0xFF
    return copy


FORCED = {"device": True}  # False: the group's own decision (gloo: host tensors)


def _force_device_carriage() -> None:
    """CPU destinations travel as device tensors do (while ``FORCED``), and take the
    slabs when large, as device destinations do."""
    from s3ckpt.dcp import process_group, restore

    decide = process_group.carriage

    def forced(backend: str, device_type: str) -> Any:
        return process_group.Carry.DEVICE if FORCED["device"] else decide(backend, device_type)

    process_group.carriage = forced  # type: ignore[assignment]
    restore.through_slabs = lambda destination, nbytes: nbytes >= restore.SLAB_MIN_ITEM  # type: ignore[assignment]


def _load(uri: str, s3: dict[str, Any], targets: dict[str, Any]) -> str | None:
    """Load into ``targets`` with the group; the error every rank raised, if any."""
    import torch.distributed.checkpoint as dcp

    from s3ckpt import S3StorageReader, unwrap

    reader = S3StorageReader(
        uri, process_group=dist.group.WORLD, bounce_bytes=BOUNCE, request_size=REQUEST, **s3
    )
    try:
        dcp.load(targets, storage_reader=reader)
    except BaseException as exc:
        error = unwrap(exc)
        return f"{type(error).__name__}: {error}"
    return None


def forced_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], through: dict[str, dict],
    uris: dict[str, str], out_dir: str,
) -> None:  # fmt: skip
    """Four loads on the forced path: raw and zstd checkpoints (GETs counted by the
    parent's proxies, ``through``), bytes damaged between ranks, a rank whose GETs fail;
    before them, one in host memory whose GETs the parent damages once ("reread"), by
    destinations that would take the slabs in an unshared load."""
    from _shared_read_worker import _fail_fetches

    _init(rank, world_size, port)
    try:
        _force_device_carriage()
        recorder = Recorder()
        recorder.install()
        report: dict[str, Any] = {}
        FORCED["device"] = False
        targets = targets_for(raw_state(), "cpu")
        error = _load(uris["raw"], through["reread"], targets)
        report["reread"] = {"error": error, "exact": exact(targets, raw_state())}
        FORCED["device"] = True
        for case, state in (("raw", raw_state()), ("zstd", zstd_state())):
            recorder.clear()
            targets = targets_for(state, "cpu")
            error = _load(uris[case], through[case], targets)
            report[case] = {"error": error, "exact": exact(targets, state), **recorder.report()}
        recorder.damage_sends = True
        report["damaged"] = {"error": _load(uris["raw"], s3, targets_for(raw_state(), "cpu"))}
        recorder.damage_sends = False
        if rank == 1:
            _fail_fetches(rank)
        report["failing"] = {"error": _load(uris["raw"], s3, targets_for(raw_state(), "cpu"))}
        _report(out_dir, rank, report)
    finally:
        dist.destroy_process_group()


def nccl_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], through: dict[str, Any], uri: str,
    out_dir: str,
) -> None:  # fmt: skip
    """One GPU per rank, a "cpu:gloo,cuda:nccl" group: CUDA destinations over NCCL, GETs
    counted by the parent's proxy (``through``); then bytes damaged between the ranks."""
    import os
    from datetime import timedelta

    from s3ckpt.dcp import process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    try:
        recorder = Recorder()
        recorder.install()
        state = raw_state()
        targets = targets_for(state, f"cuda:{rank}")
        error = _load(uri, through, targets)
        report = {
            "error": error,
            "exact": exact(targets, state),
            "on_device": all(t.is_cuda for t in targets.values() if isinstance(t, torch.Tensor)),
            "carriage": process_group.carriage(dist.get_backend_config(), "cuda").value,
            **recorder.report(),
        }
        recorder.damage_sends = True
        report["damaged"] = _load(uri, s3, targets_for(state, f"cuda:{rank}"))
        _report(out_dir, rank, report)
    finally:
        dist.destroy_process_group()
