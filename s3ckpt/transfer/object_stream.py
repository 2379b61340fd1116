"""``ObjectStream``: one data object of a rank's save, cut into parts as items arrive.

The producer thread appends items; the stream cuts the object into parts on the fly
(:class:`~s3ckpt.transfer.parts.PartCutter`) and hands them to the uploader in batches
(:class:`ObjectRequests`: up to one part per request slot, a quarter of the byte budget),
each batch one task: sent by native threads as one call where the store can
(:mod:`s3ckpt.s3.wire.batch`), so the GIL changes hands per batch, not per part. A part
inside one item is sent as a ``memoryview`` of that item's memory; only parts straddling
item boundaries are joined into a fresh buffer (:func:`join`). Each part carries its
CRC32C: parts of an item are cut on its checksum blocks, so that CRC is combined from the
item's block CRC32Cs (computed once, for the manifest) instead of read from memory a
second time.
"""

from __future__ import annotations

from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, Protocol

from s3ckpt.format.checksums import combine, crc_of, range_crc
from s3ckpt.s3.store import Body, PartResult
from s3ckpt.transfer.parts import PartCutter
from s3ckpt.transfer.thread_mode import joined

try:
    from s3ckpt.transfer import _gather
except ImportError:  # pragma: no cover - exercised where no C compiler is available
    _gather = None  # type: ignore[assignment]


class ObjectRequests(Protocol):
    """What a stream asks of the uploader: its requests, run as tasks on the I/O loop, and
    how many parts (and bytes) to send as one batch."""

    block_size: int
    checksums: bool
    batch_parts: int
    batch_bytes: int

    def spawn(self, coro: Coroutine[Any, Any, Any], nbytes: int) -> Future[Any]: ...

    async def put(self, key: str, body: Body, checksum: int | None) -> Any: ...

    async def create(self, key: str) -> str: ...

    async def parts(
        self, key: str, created: Future[str], batch: list[tuple[int, Body, int | None]]
    ) -> list[PartResult]: ...

    async def complete(
        self, key: str, size: int, created: Future[str], batches: list[Future[list[PartResult]]]
    ) -> Any: ...


class ObjectStream:
    """One data object being written, fed item by item from the producer thread.

    Parts are held back while the object is no larger than one part: if it ends there it
    is sent as a single PUT; the moment it outgrows a part, the multipart upload starts.
    """

    def __init__(self, uploader: ObjectRequests, key: str, part_size: int, min_part: int) -> None:
        self.uploader = uploader
        self.key = key
        self.part_size = part_size
        self.cutter = PartCutter(part_size, min_part, uploader.block_size)
        self.checksums = uploader.checksums
        self.size = 0
        self.data: dict[int, memoryview] = {}  # items with pieces still to send
        self.crcs: dict[int, tuple[int, ...]] = {}  # their block CRC32Cs, where known
        self.count = 0
        self.held: list[tuple[Body, int | None]] = []
        self.created: Future[str] | None = None
        self.batch: list[tuple[int, Body, int | None]] = []  # parts not yet handed over
        self.batch_bytes = 0
        self.sent = 0  # parts numbered so far
        self.batches: list[Future[list[PartResult]]] = []
        self.completion: Future[Any] | None = None  # the object, once stored

    def add(self, data: memoryview, crcs: tuple[int, ...] | None = None) -> int:
        """Append an item (with its block CRC32Cs, if known); returns its offset in the object."""
        number, offset = self.count, self.size
        self.count += 1
        self.size += len(data)
        if len(data):
            self.data[number] = data
            if crcs is not None:
                self.crcs[number] = crcs
        for part in self.cutter.add(number, len(data)):
            self._emit(part)
        return offset

    def finish(self) -> None:
        for part in self.cutter.finish():
            self._emit(part)
        up = self.uploader
        if self.created is None:
            body = join([memoryview(b) for b, _ in self.held]) if self.held else b""
            checksum = _combined([(c, len(b)) for b, c in self.held]) if self.checksums else None
            self.completion = up.spawn(up.put(self.key, body, checksum), len(body))
        else:
            self._hand_over()
            self.completion = up.spawn(
                up.complete(self.key, self.size, self.created, self.batches), 0
            )

    def _emit(self, part: list[tuple[int, int, int]]) -> None:
        part = [(item, start, end) for item, start, end in part if end > start]
        pieces = [self.data[item][start:end] for item, start, end in part]
        checksum = (
            _combined([(self._crc(*p), p[2] - p[1]) for p in part]) if self.checksums else None
        )
        for item, _, end in part:
            if end == len(self.data[item]):
                del self.data[item]
                self.crcs.pop(item, None)
        body = join(pieces) if pieces else b""
        if self.created is None and sum(len(b) for b, _ in self.held) + len(body) <= self.part_size:
            self.held.append((body, checksum))
            return
        up = self.uploader
        if self.created is None:
            self.created = up.spawn(up.create(self.key), 0)
            for held, held_checksum in self.held:
                self._send(held, held_checksum)
            self.held = []
        self._send(body, checksum)

    def _crc(self, item: int, start: int, end: int) -> int:
        """CRC32C of a piece of an item: combined from its block CRCs where the piece is
        whole blocks, else computed."""
        data, blocks = self.data[item], self.crcs.get(item)
        if blocks is not None:
            crc = range_crc(blocks, self.uploader.block_size, len(data), start, end)
            if crc is not None:
                return crc
        return crc_of(data[start:end])

    def _send(self, body: Body, checksum: int | None) -> None:
        """Number a part and add it to the batch, handed over once full."""
        up = self.uploader
        if self.batch and self.batch_bytes + len(body) > up.batch_bytes:
            self._hand_over()
        self.sent += 1
        self.batch.append((self.sent, body, checksum))
        self.batch_bytes += len(body)
        if len(self.batch) >= up.batch_parts:
            self._hand_over()

    def _hand_over(self) -> None:
        if not self.batch:
            return
        up = self.uploader
        assert self.created is not None
        batch, nbytes = self.batch, self.batch_bytes
        self.batch, self.batch_bytes = [], 0
        self.batches.append(up.spawn(up.parts(self.key, self.created, batch), nbytes))


def _combined(pieces: list[tuple[int | None, int]]) -> int:
    """The CRC32C of consecutive pieces from theirs: ``(crc, length)`` each."""
    total = 0  # the CRC32C of no bytes
    for crc, length in pieces:
        assert crc is not None
        total = combine(total, crc, length)
    return total


def join(pieces: list[memoryview]) -> Body:
    """One body from pieces: the piece itself when there is one (no copy), else a joined
    copy made without holding the GIL (:mod:`s3ckpt.transfer._gather`, or
    :func:`~s3ckpt.transfer.thread_mode.joined` where the C helper is not built)."""
    if len(pieces) == 1:
        return pieces[0]
    if _gather is not None:
        return _gather.join(pieces)
    return joined(pieces)
