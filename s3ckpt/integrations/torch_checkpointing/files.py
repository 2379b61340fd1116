"""The files of torch-checkpointing checkpoints as s3ckpt stores them: one save's writes,
and a committed checkpoint's reads.

A file that torch-checkpointing writes (``model_0.pt``, ``step_0.pt``...) becomes one data
object of its rank's save, ``data/r<rank>-<save>-<n>.bin``, uploaded front to back as it
is written (:class:`~s3ckpt.transfer.object_writer.ObjectWriter`); the rank's index object
maps each file's name to its object and block CRC32Cs. Keeping names out of the keys is
what makes the checkpoint s3ckpt's: the catalog knows these objects (``s3ckpt gc`` removes
those of a save that died), and a save never writes over an object of a committed
checkpoint. Reads go through the manifest and the index: a file is found only in a
committed checkpoint, and every byte read is checked against its block's CRC32C.
"""

from __future__ import annotations

import io
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from s3ckpt.config import S3URI
from s3ckpt.errors import CheckpointExistsError, CorruptCheckpointError
from s3ckpt.format.checksums import verify_blocks
from s3ckpt.format.layout import StoredItem, data_key
from s3ckpt.format.manifest import MANIFEST_NAME, Manifest
from s3ckpt.format.rank_index import ItemOwners
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.inflight import mark_in_flight
from s3ckpt.transfer.object_writer import ObjectWriter, WrittenObject
from s3ckpt.transfer.rank_index import read_index

UNALIGNED_READ_LIMIT = 64 * 1024 * 1024  # bytes one unaligned read fetches at most


@dataclass
class Saving:
    """One rank's writes into one checkpoint, until the commit."""

    location: S3URI
    save_id: str
    rank: int
    files: dict[str, WrittenObject] = field(default_factory=dict)
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def start(cls, store: ObjectStore, location: S3URI, rank: int) -> Saving:
        """Refuse a committed checkpoint (its objects stay untouched); record the save as
        in flight, so ``gc`` leaves its objects alone while it runs."""
        if io_loop().run(store.exists(location.key(MANIFEST_NAME))):
            raise CheckpointExistsError(
                f"{location} is already committed; remove it first (Storage.rmdir, or "
                "s3ckpt rm) to save a new checkpoint under that name"
            )
        saving = cls(location, uuid.uuid4().hex[:16], rank)
        io_loop().run(mark_in_flight(store, location, saving.save_id))
        return saving

    def open(self, store: ObjectStore) -> ObjectWriter:
        with self._lock:
            number, self._next = self._next, self._next + 1
        return ObjectWriter(store, self.location.key(data_key(self.rank, self.save_id, number)))

    def record(self, name: str, written: WrittenObject) -> None:
        with self._lock:
            self.files[name] = written

    def items(self) -> dict[str, WrittenObject]:
        with self._lock:
            return dict(self.files)


class FileWriter(io.RawIOBase):
    """A file object for one file of a save: bytes go to S3 as parts fill; ``close``
    completes the object and records the file, leaving the ``with`` block by an exception
    aborts it (nothing is recorded)."""

    def __init__(self, saving: Saving, name: str, writer: ObjectWriter) -> None:
        self._saving, self._name, self._writer = saving, name, writer
        self._written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self.closed:
            raise ValueError("write to a closed file")
        count = self._writer.write(data)
        self._written += count
        return count

    def tell(self) -> int:
        return self._written

    def close(self) -> None:
        if not self.closed:
            try:
                self._saving.record(self._name, self._writer.close())
            finally:
                super().close()

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if kind is None:
            self.close()
            return
        self._writer.abort()
        super().close()


@dataclass
class Committed:
    """A committed checkpoint as its readers need it: its manifest, which rank wrote each
    file, and the index objects read so far (one per rank whose files are read)."""

    location: S3URI
    manifest: Manifest
    owners: ItemOwners
    names: tuple[str, ...]
    _indexes: dict[int, dict[str, StoredItem]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def stored(self, store: ObjectStore, name: str) -> StoredItem:
        """Where file ``name`` lives and its checksums; ``FileNotFoundError`` if it is not
        a file of this checkpoint."""
        if name not in self.names:
            raise FileNotFoundError(f"no file {name!r} in the checkpoint {self.location}")
        rank = self.owners.rank_of(name, 0)
        with self._lock:
            files = self._indexes.get(rank)
        if files is None:
            ref = {i.rank: i for i in self.manifest.indexes}.get(rank)
            if ref is None:
                raise CorruptCheckpointError(
                    f"{self.location}: rank {rank} wrote {name!r}, but the manifest lists no "
                    "index object of that rank"
                )
            index = io_loop().run(read_index(store, self.location, ref, self.manifest.etags()))
            files = {item.fqn: item.stored for item in index.items}
            with self._lock:
                self._indexes[rank] = files
        return files[name]


class FileReader(io.RawIOBase):
    """One file of a committed checkpoint, read with ranged GETs and checked by block.

    A read that starts and ends on block boundaries (torch-checkpointing's parallel fill
    reads whole chunks) lands in the caller's memory directly; any other is widened to its
    blocks in a buffer of its own, kept for the reads that follow it.
    """

    def __init__(self, store: ObjectStore, location: S3URI, name: str, item: StoredItem) -> None:
        self._store, self._item = store, item
        self._key, self._what = location.key(item.key), f"{location}/{name}"
        self._position = 0
        self._kept: tuple[int, memoryview] | None = None  # a widened read: start, bytes

    @property
    def size(self) -> int:
        return self._item.length

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OSError(f"negative seek position {base + offset}")
        self._position = base + offset
        return self._position

    def readall(self) -> bytes:
        left = max(self.size - self._position, 0)
        data = bytearray(left)
        view = memoryview(data)
        done = 0
        while done < left:
            done += self.readinto(view[done:])
        return bytes(data)

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        start = self._position
        count = min(len(target), self.size - start)
        if count <= 0:
            return 0
        first, last = self._item.block_span(start, start + count)
        if first == start and last == start + count:
            self._fetch(first, target[:count])
        else:
            if last - first > UNALIGNED_READ_LIMIT:
                last = first + UNALIGNED_READ_LIMIT
                count = last - start
            kept = self._widened(first, last)
            target[:count] = kept[start - first : start - first + count]
        self._position += count
        return count

    def _widened(self, first: int, last: int) -> memoryview:
        if self._kept is not None:
            at, data = self._kept
            if at <= first and last <= at + len(data):
                return data[first - at :]
        data = memoryview(bytearray(last - first))
        self._fetch(first, data)
        self._kept = (first, data)
        return data

    def _fetch(self, first: int, view: memoryview) -> None:
        """Bytes ``[first, first + len(view))`` of the file (block-aligned), checked; a
        read that fails its check is read once more on fresh connections."""
        item = self._item
        start = item.offset + first
        for attempt in range(2):
            if len(view):
                io_loop().run(self._store.read_range(self._key, start, start + len(view), view))
            try:
                verify_blocks(
                    view, item.crc32c, block_size=item.block_size,
                    first_block=first // item.block_size, what=self._what,
                )  # fmt: skip
                return
            except CorruptCheckpointError:
                if attempt:
                    raise
                io_loop().run(self._store.close_idle_connections())
