"""``ObjectWriter``: one object written front to back by a caller that holds no tensor list.

The engine's uploads (:mod:`s3ckpt.transfer.upload`) know every item before they start;
files written through a stream (``torch.save`` into a file object, an export writing a
safetensors file) arrive a few bytes at a time and their size is known only at the end.
Bytes are gathered into parts of ``part_size``; each full part is uploaded on the I/O loop
while the next fills (at most ``ahead`` parts in flight, so memory stays
``(ahead + 1) x part_size``; ``ahead=0`` uploads each part before the next fills). An object that never fills one part is one ``PutObject``.
Every part carries its CRC32C, combined from the CRC32C of each ``block_size`` block, which
the writer also keeps: they are what an index records to check reads of the object later.
A failure, or :meth:`ObjectWriter.abort`, aborts the multipart upload; one left by a
killed process is ``s3ckpt gc``'s.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from s3ckpt.format.checksums import block_crcs, combine
from s3ckpt.format.layout import DEFAULT_BLOCK_SIZE
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore, PartResult
from s3ckpt.transfer.parts import MiB

log = logging.getLogger(__name__)

PART_SIZE = 64 * MiB


@dataclass(frozen=True)
class WrittenObject:
    """An object once written: what an index and a manifest record of it."""

    key: str
    size: int
    etag: str
    block_size: int
    block_crcs: tuple[int, ...]


class ObjectWriter:
    """Writes ``key`` front to back (:meth:`write` any number of times, then :meth:`close`)."""

    def __init__(
        self,
        store: ObjectStore,
        key: str,
        *,
        part_size: int = PART_SIZE,
        block_size: int = DEFAULT_BLOCK_SIZE,
        ahead: int = 2,
    ) -> None:
        if part_size % block_size:
            raise ValueError(f"part_size {part_size} is not a multiple of block_size {block_size}")
        self.store, self.key = store, key
        self._part_size, self._block_size, self._ahead = part_size, block_size, ahead
        self._buffer = bytearray()
        self._size = 0
        self._block_crcs: list[int] = []
        self._upload_id: str | None = None
        self._parts: list[Future[PartResult]] = []
        self._in_flight: deque[Future[PartResult]] = deque()  # sent, oldest first
        self._closed = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._closed:
            raise ValueError(f"write to {self.key} after it was closed or given up")
        view = memoryview(data).cast("B")
        taken = 0
        while taken < len(view):
            room = self._part_size - len(self._buffer)
            piece = view[taken : taken + room]
            self._buffer += piece
            taken += len(piece)
            if len(self._buffer) == self._part_size:
                self._send_part()
        self._size += taken
        return taken

    def close(self) -> WrittenObject:
        """Upload what is left and complete the object; aborts it if that fails."""
        if self._closed:
            raise ValueError(f"{self.key} was already closed or given up")
        try:
            if self._upload_id is None:
                body = self._buffer
                etag = io_loop().run(self.store.put(self.key, body, crc32c=self._checksum(body)))
            else:
                if self._buffer:
                    self._send_part()
                parts = [part.result() for part in self._parts]
                complete = self.store.complete_multipart(self.key, self._upload_id, parts)
                etag = io_loop().run(complete)
                self._upload_id = None
        except BaseException:
            self.abort()
            raise
        self._closed = True
        crcs = tuple(self._block_crcs) or block_crcs(memoryview(b""), self._block_size)
        return WrittenObject(self.key, self._size, etag, self._block_size, crcs)

    def abort(self) -> None:
        """Give the object up: parts in flight are waited for, the upload aborted."""
        self._closed = True
        upload_id, self._upload_id = self._upload_id, None
        for part in self._parts:
            part.exception()  # settled either way before the abort
        if upload_id is None:
            return
        try:
            io_loop().run(self.store.abort_multipart(self.key, upload_id))
        except Exception as exc:
            log.warning(
                "could not abort the upload of %s (under a checkpoint s3ckpt gc removes it, "
                "elsewhere an AbortIncompleteMultipartUpload lifecycle rule): %s",
                self.key,
                exc,
            )

    def _send_part(self) -> None:
        try:
            if self._upload_id is None:
                self._upload_id = io_loop().run(self.store.create_multipart(self.key))
            body, self._buffer = self._buffer, bytearray()  # the upload owns it now
            checksum = self._checksum(body)
            number = len(self._parts) + 1
            coro = self.store.upload_part(self.key, self._upload_id, number, body, checksum)
            part = io_loop().submit(coro)
            self._parts.append(part)
            self._in_flight.append(part)
            self._settle(self._ahead)
        except BaseException:
            self.abort()
            raise

    def _settle(self, limit: int) -> None:
        """Wait until at most ``limit`` parts are in flight; raise a failed part's error."""
        while self._in_flight and (self._in_flight[0].done() or len(self._in_flight) > limit):
            self._in_flight.popleft().result()

    def _checksum(self, body: bytes | bytearray) -> int:
        """The CRC32C of a part, combined from those of its blocks, which are kept (a part
        starts on a block boundary)."""
        crcs = block_crcs(memoryview(body), self._block_size)
        if body:
            self._block_crcs.extend(crcs)
        total = crcs[0]
        for n, crc in enumerate(crcs[1:], start=1):
            total = combine(total, crc, min(self._block_size, len(body) - n * self._block_size))
        return total
