"""A multi-rank load that reads each stored byte range once across its process group.

Given ``S3StorageReader(process_group=...)``, the ranks of a load tell each other, in one
small all-gather, which stored ranges their read items need and how each would travel;
:func:`~s3ckpt.transfer.shares.plan_shares` gives every range that several ranks need to
one of them. Each rank then fetches what only it needs and the shared ranges it was
given, with the usual parallel ranged GETs, CRC32C checks and re-reads of damage, and
passes each shared range to the ranks that need it with point-to-point sends over the
group. Receivers verify the bytes against their block CRC32Cs before the planner sees them.

How a range travels (:func:`~s3ckpt.dcp.process_group.carriage`, from the group's
backend and the destination's device type, the same on every rank):

* as host tensors (gloo), for CPU destinations, and for device destinations where the
  group cannot carry device memory: bytes land where an unshared load of a CPU tensor
  would put them (the destination, or the scratch buffer the item has anyway), so sharing
  adds no host memory for CPU destinations; a device destination gets a host buffer for
  the load here (``stage=False``), the memory gloo sends from and receives into;
* in device memory, where the group carries it (NCCL for CUDA destinations), with no
  host buffer of an item's size on any rank: the owner fetches the item through the
  bounce slabs of :mod:`s3ckpt.dcp.device_load` as an unshared load would, into its
  destination or a device buffer, and sends from there (an item that does not pass
  through slabs, small or compressed, is moved to device memory as soon as it is
  verified); a receiver receives into its destination or a device buffer and checks
  what arrived (:func:`check_received`), copied back to the host one slab at a time. The
  owner's check covers the store to the owner; the receiver's covers the owner's device
  memory, the transport between the ranks and its own memory;
* not at all where the group carries neither (an NCCL-only group, CPU destinations):
  each rank needing the range reads it itself.

A range needed by one rank only costs no traffic between ranks; a load with nothing
replicated (pure FSDP) makes the one all-gather and then reads as it would alone.

Failures never leave a rank waiting: a rank that cannot plan, fetch its share or make
room for what it will receive says so in the next collective, and every rank then raises
that rank's error (its own first); no rank enters a transfer before every rank has said
it is ready. A compressed item is fetched and decoded (and so verified) by its owner,
which passes on the decoded bytes: the store is read once, and the receivers check those
bytes against the same block CRC32Cs (which are of the raw bytes) without decoding.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from s3ckpt.dcp import device_load
from s3ckpt.dcp.compat import LoadPlanner
from s3ckpt.dcp.fetch import ItemFetch, ReadPlan, ReadSource
from s3ckpt.dcp.process_group import Carry, GroupBroadcast, Transfer, portable
from s3ckpt.dcp.restore import PendingRead, hand_to_planner
from s3ckpt.format.checksums import verify_blocks
from s3ckpt.transfer.shares import SharePlan, Span, plan_shares

Received = tuple[PendingRead, int]  # (item, the rank it came from)
_Piece = tuple[PendingRead, int, int, int]  # (item, sender, first byte in the span, bytes)

# How a range travels: ("host", "cpu"), or ("device", the destination's device type).
Route = tuple[str, str]
HOST: Route = (Carry.HOST.value, "cpu")


@dataclass(frozen=True)
class Routed:
    """The shared ranges that travel one way: their plan (the same on every rank) and this
    rank's item for each range it needs."""

    route: Route
    plan: SharePlan
    items: dict[Span, PendingRead]

    @property
    def in_device(self) -> bool:
        return self.route != HOST

    def owned(self, rank: int) -> list[PendingRead]:
        return [self.items[span] for span in self.plan.fetched_by(rank)]

    def receives(self, rank: int) -> list[tuple[PendingRead, int]]:
        """``(item, sending rank)`` for every range ``rank`` receives, in tag order."""
        return [(self.items[span], owner) for span, owner in self.plan.receives(rank)]

    def transfers(
        self, rank: int, kept: dict[int, PendingRead]
    ) -> tuple[list[Transfer], list[Transfer]]:
        """What ``rank`` sends (its fetched items, ``kept`` by id) and receives."""
        tags = self.plan.tags
        sends = [
            (kept[id(self.items[span])].raw, peer, tags[span])
            for span, peer in self.plan.sends(rank)
        ]
        receives = [
            (self.items[span].raw, owner, tags[span]) for span, owner in self.plan.receives(rank)
        ]
        return sends, receives


def in_device_memory(group: GroupBroadcast) -> Callable[[torch.device], bool]:
    """Whether a destination on a device receives its shared bytes in device memory (the
    ``stage`` of :func:`~s3ckpt.dcp.restore.prepare` for a load over ``group``)."""
    return functools.partial(_carried_in_device, group)


def _carried_in_device(group: GroupBroadcast, device: torch.device) -> bool:
    return group.carries(device.type) is Carry.DEVICE


class SharedRead:
    """One ``read_data`` of a rank whose reader was given a process group."""

    def __init__(self, group: GroupBroadcast) -> None:
        self.group = group
        self.rank = group.rank

    def run(self, planned: ReadPlan | Exception, planner: LoadPlanner) -> None:
        """Run the reader's plan (staged by :func:`in_device_memory`), sharing ranges with
        the other ranks; or, if the reader could not plan, tell them so and raise."""
        pending: list[PendingRead] = []
        primaries: dict[Route, dict[Span, PendingRead]] = {}
        try:
            if isinstance(planned, Exception):
                raise planned
            pending = planned.items
            primaries = _primaries(pending, self._route)
            outcome: Any = ("needs", {r: sorted(spans) for r, spans in primaries.items()})
        except Exception as exc:
            outcome = ("failed", portable(exc))
            failure: Exception | None = exc
        else:
            failure = None
        gathered = self.group.all_gather(outcome)
        _raise_first(failure, [o[1] for o in gathered if o[0] == "failed"])
        assert isinstance(planned, ReadPlan)
        routes = _routes([o[1] for o in gathered], primaries)
        if not any(routed.plan.shared for routed in routes):
            ItemFetch(planned.source).run(pending, planner)
            return
        self._share(routes, planned, planner)

    def _route(self, item: PendingRead) -> Route | None:
        """How ``item``'s range travels; ``None``: it does not, each rank reads it."""
        if item.destination is None:  # bytes for the planner: host memory
            return HOST if self.group.carries("cpu") is not None else None
        device = item.destination.device.type
        carry = self.group.carries(device)
        return None if carry is None else HOST if carry is Carry.HOST else ("device", device)

    def _share(self, routes: list[Routed], plan: ReadPlan, planner: LoadPlanner) -> None:
        rank, source = self.rank, plan.source
        receiving = [(r, item, owner) for r in routes for item, owner in r.receives(rank)]
        received = {id(item) for _, item, _ in receiving}
        owned = frozenset(id(item) for r in routes for item in r.owned(rank))
        # what this rank sends in device memory goes there as soon as it is verified
        onto_device = frozenset(id(i) for r in routes if r.in_device for i in r.owned(rank))
        failure: Exception | None = None
        kept: dict[int, PendingRead] = {}
        try:
            here = [p for p in plan.items if id(p) not in received]
            kept = ItemFetch(source).run(here, planner, keep=owned, onto_device=onto_device)
            for routed, item, _ in receiving:  # room for what arrives, before anyone sends
                if routed.in_device:
                    device_load.receive_into(item)
                else:
                    item.allocate_scratch()  # a compressed item decodes nothing here
        except Exception as exc:
            failure = exc
        statuses = self.group.all_gather(None if failure is None else portable(failure))
        _raise_first(failure, [s for s in statuses if s is not None])
        for routed in routes:
            if routed.in_device and routed.plan.shared:
                self.group.ready(routed.route[1])  # every rank, before any device transfer
        self.group.exchange([routed.transfers(rank, kept) for routed in routes])
        trust = source.trust_pickles
        for item in kept.values():
            hand_to_planner(item, planner, trust_pickles=trust)
        self._check(
            [(item, owner) for r, item, owner in receiving if not r.in_device], False, source
        )
        self._check([(item, owner) for r, item, owner in receiving if r.in_device], True, source)
        for _, item, _ in receiving:
            hand_to_planner(item, planner, trust_pickles=trust)

    def _check(
        self, received: list[tuple[PendingRead, int]], in_device: bool, source: ReadSource
    ) -> None:
        """Verify what arrived: in host memory where it is, in device memory through slabs."""
        if not in_device:
            for item, owner in received:
                verify_blocks(
                    item.raw_view,
                    item.stored.crc32c,
                    block_size=item.stored.block_size,
                    first_block=item.span[0] // item.stored.block_size,
                    what=f"{item.what} (passed on by rank {owner})",
                )
            return
        if not received:
            return
        size = device_load.slab_size([item for item, _ in received], source.request_size)
        slabs = device_load.checkout(size, source.bounce_bytes, torch.cuda.is_available())
        try:
            check_received(received, slabs)
        finally:
            device_load.give_back(slabs)


def check_received(received: list[Received], slabs: device_load.Slabs) -> None:
    """Raise :class:`~s3ckpt.errors.CorruptCheckpointError` unless every block that
    arrived in device memory matches its stored CRC32C, copied back through ``slabs``."""
    queued: deque[tuple[torch.cuda.Event | None, int, _Piece]] = deque()
    for number, piece in enumerate(_pieces(received, slabs.size)):
        slab = number % len(slabs.tensors)
        if len(queued) == len(slabs.tensors):  # the oldest copy holds this slab
            _check_copied(queued.popleft(), slabs)
        item, _, within, nbytes = piece
        slabs.tensors[slab][:nbytes].copy_(
            item.raw[within : within + nbytes], non_blocking=slabs.pinned
        )
        event = None
        if item.raw.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(item.raw.device))
        queued.append((event, slab, piece))
    while queued:
        _check_copied(queued.popleft(), slabs)


def _pieces(received: list[Received], size: int) -> Iterator[_Piece]:
    for item, sender in received:
        step = size // item.stored.block_size * item.stored.block_size
        total = item.span[1] - item.span[0]
        for within in range(0, total, step):
            yield item, sender, within, min(step, total - within)


def _check_copied(
    copied: tuple[torch.cuda.Event | None, int, _Piece], slabs: device_load.Slabs
) -> None:
    event, slab, (item, sender, within, nbytes) = copied
    if event is not None:
        event.synchronize()
    block = item.stored.block_size
    verify_blocks(
        slabs.views[slab][:nbytes],
        item.stored.crc32c,
        block_size=block,
        first_block=(item.span[0] + within) // block,
        what=f"{item.what} (passed on by rank {sender})",
    )


def _routes(
    needs: list[dict[Route, list[Span]]], primaries: dict[Route, dict[Span, PendingRead]]
) -> list[Routed]:
    """One plan per route, in the same order and with tags of their own on every rank."""
    routes: list[Routed] = []
    tags = 0
    for route in sorted({r for rank in needs for r in rank}):
        plan = plan_shares([rank.get(route, []) for rank in needs], first_tag=tags)
        routes.append(Routed(route, plan, primaries.get(route, {})))
        tags += len(plan.owners)
    return routes


def _primaries(
    pending: list[PendingRead], route_of: Callable[[PendingRead], Route | None]
) -> dict[Route, dict[Span, PendingRead]]:
    """The stored range of every item that can travel, each range's first item, by route;
    the others (the same range read twice by one rank, rare) are fetched as they are."""
    primaries: dict[Route, dict[Span, PendingRead]] = {}
    for item in pending:
        route = route_of(item)
        if item.stored_span[1] == item.stored_span[0] or route is None:
            continue
        start = item.stored.offset + item.stored_span[0]
        span = (item.stored.key, start, start + item.stored_span[1] - item.stored_span[0])
        primaries.setdefault(route, {}).setdefault(span, item)
    return primaries


def _raise_first(own: Exception | None, others: list[BaseException]) -> None:
    """This rank's error, else the first other rank's: every rank stops together."""
    if own is not None:
        raise own
    if others:
        raise others[0]
