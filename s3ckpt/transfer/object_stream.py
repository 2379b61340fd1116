"""``ObjectStream``: one data object of a rank's save, cut into requests as items arrive.

The producer thread appends items; the stream cuts the object into parts on the fly
(:class:`~s3ckpt.transfer.parts.PartCutter`), gathers them in batches (up to one part per
request slot, a quarter of the byte budget: the caller's ``batch_parts``/``batch_bytes``)
and returns the requests they make, in order, as values (:data:`Request`): the uploader
(:class:`~s3ckpt.transfer.upload.RankUploader`) queues each as a task on the I/O loop, so
the stream calls nothing and knows no uploader. A batch is sent by native threads as one
call where the store can (:mod:`s3ckpt.s3.wire.batch`), so the GIL changes hands per batch,
not per part. A part inside one item is sent as a ``memoryview`` of that item's memory;
only parts straddling item boundaries are joined into a fresh buffer (:func:`join`). Each
part carries its CRC32C: parts of an item are cut on its checksum blocks, so that CRC is
combined from the item's block CRC32Cs (computed once, for the manifest) instead of read
from memory a second time.
"""

from __future__ import annotations

from dataclasses import dataclass

from s3ckpt.format.checksums import combine, crc_of, range_crc
from s3ckpt.s3.store import Body
from s3ckpt.transfer.parts import PartCutter
from s3ckpt.transfer.thread_mode import joined

try:
    from s3ckpt.transfer import _gather
except ImportError:  # pragma: no cover - exercised where no C compiler is available
    _gather = None  # type: ignore[assignment]

Part = tuple[int, Body, int | None]  # (part number, body, CRC32C or None)


@dataclass(frozen=True)
class PutObject:
    """The whole object as one PutObject: it ended within one part."""

    key: str
    body: Body
    checksum: int | None


@dataclass(frozen=True)
class StartUpload:
    """CreateMultipartUpload: the object outgrew one part. Comes before its parts."""

    key: str


@dataclass(frozen=True)
class SendParts:
    """A batch of parts of the started upload, ``nbytes`` in all."""

    key: str
    parts: list[Part]
    nbytes: int


@dataclass(frozen=True)
class CompleteUpload:
    """CompleteMultipartUpload, once every batch before it is sent: the object's last request."""

    key: str
    size: int


Request = PutObject | StartUpload | SendParts | CompleteUpload


class ObjectStream:
    """One data object being written, fed item by item from the producer thread.

    Parts are held back while the object is no larger than one part: if it ends there it
    is one :class:`PutObject`; the moment it outgrows a part, :class:`StartUpload`, then
    :class:`SendParts` batches and a last :class:`CompleteUpload`.
    """

    def __init__(
        self,
        key: str,
        part_size: int,
        min_part: int,
        *,
        block_size: int,
        checksums: bool,
        batch_parts: int,
        batch_bytes: int,
    ) -> None:
        self.key = key
        self.part_size = part_size
        self.block_size = block_size
        self.cutter = PartCutter(part_size, min_part, block_size)
        self.checksums = checksums
        self.batch_parts, self.batch_limit = batch_parts, batch_bytes
        self.size = 0
        self.data: dict[int, memoryview] = {}  # items with pieces still to send
        self.crcs: dict[int, tuple[int, ...]] = {}  # their block CRC32Cs, where known
        self.count = 0
        self.held: list[tuple[Body, int | None]] = []
        self.started = False  # whether the multipart upload was asked for
        self.batch: list[Part] = []  # parts not yet handed over
        self.batch_bytes = 0
        self.sent = 0  # parts numbered so far
        self._requests: list[Request] = []  # made by the current call

    def add(
        self, data: memoryview, crcs: tuple[int, ...] | None = None
    ) -> tuple[int, list[Request]]:
        """Append an item (with its block CRC32Cs, if known): its offset in the object, and
        the requests it completed."""
        number, offset = self.count, self.size
        self.count += 1
        self.size += len(data)
        if len(data):
            self.data[number] = data
            if crcs is not None:
                self.crcs[number] = crcs
        for part in self.cutter.add(number, len(data)):
            self._emit(part)
        return offset, self._taken()

    def finish(self) -> list[Request]:
        """The object's last requests: ending with its :class:`PutObject` or :class:`CompleteUpload`."""
        for part in self.cutter.finish():
            self._emit(part)
        if not self.started:
            body = join([memoryview(b) for b, _ in self.held]) if self.held else b""
            checksum = _combined([(c, len(b)) for b, c in self.held]) if self.checksums else None
            self._requests.append(PutObject(self.key, body, checksum))
        else:
            self._hand_over()
            self._requests.append(CompleteUpload(self.key, self.size))
        return self._taken()

    def _taken(self) -> list[Request]:
        requests, self._requests = self._requests, []
        return requests

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
        if not self.started and sum(len(b) for b, _ in self.held) + len(body) <= self.part_size:
            self.held.append((body, checksum))
            return
        if not self.started:
            self.started = True
            self._requests.append(StartUpload(self.key))
            for held, held_checksum in self.held:
                self._send(held, held_checksum)
            self.held = []
        self._send(body, checksum)

    def _crc(self, item: int, start: int, end: int) -> int:
        """CRC32C of a piece of an item: combined from its block CRCs where the piece is
        whole blocks, else computed."""
        data, blocks = self.data[item], self.crcs.get(item)
        if blocks is not None:
            crc = range_crc(blocks, self.block_size, len(data), start, end)
            if crc is not None:
                return crc
        return crc_of(data[start:end])

    def _send(self, body: Body, checksum: int | None) -> None:
        """Number a part and add it to the batch, handed over once full."""
        if self.batch and self.batch_bytes + len(body) > self.batch_limit:
            self._hand_over()
        self.sent += 1
        self.batch.append((self.sent, body, checksum))
        self.batch_bytes += len(body)
        if len(self.batch) >= self.batch_parts:
            self._hand_over()

    def _hand_over(self) -> None:
        if not self.batch:
            return
        batch, nbytes = self.batch, self.batch_bytes
        self.batch, self.batch_bytes = [], 0
        self._requests.append(SendParts(self.key, batch, nbytes))


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
