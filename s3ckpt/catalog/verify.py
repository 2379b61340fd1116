"""Verifying a committed checkpoint: every stored byte re-read and checked against the manifest.

Loading checks every byte it reads, but a checkpoint that sits on storage for weeks is read
only when it is needed, which is the worst time to find a flipped bit. ``verify`` reads it
all ahead of time and reports *every* damaged item rather than stopping at the first:

1. one LIST of the checkpoint's directory: every object the manifest names must exist with
   the size it records (items in a missing or short object are reported unread);
2. the metadata object's size and CRC32C, and (format 2) every rank's index object's: the
   items of a missing or damaged index are reported as unchecked;
3. every item, cut into pieces of whole checksum blocks and fetched with the parallel,
   coalesced ranged GETs of :class:`s3ckpt.transfer.download.Downloader`, each block compared with
   its CRC32C as soon as its piece arrives.

Memory stays bounded: pieces are fetched in batches that share one reusable buffer of at
most ``max_buffer`` bytes (or one checksum block, if that is larger), however large the
checkpoint. Checks use :mod:`s3ckpt.format.checksums`, the same torch-free code the loader uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from s3ckpt.catalog.reporting import SILENT, Reporter
from s3ckpt.catalog.scan import open_store, read_committed
from s3ckpt.config import S3URI, S3Config
from s3ckpt.errors import CorruptCheckpointError, StorageError
from s3ckpt.format.checksums import first_bad_block
from s3ckpt.format.compression import CODECS, RAW, decode_block
from s3ckpt.format.layout import StoredItem, stored_span
from s3ckpt.format.manifest import ItemEntry, Manifest
from s3ckpt.format.rank_index import RankIndex
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectMeta, ObjectStore
from s3ckpt.transfer.checked import get_intact
from s3ckpt.transfer.download import REREADS, Downloader, ReadTarget
from s3ckpt.transfer.rank_index import read_each

MiB = 1024 * 1024
DEFAULT_MAX_BUFFER = 256 * MiB
_PIECE = 64 * MiB  # the largest piece of one item (rounded down to whole blocks)


@dataclass(frozen=True)
class Problem:
    """One piece of damage :func:`verify_checkpoint` found: the item (or ``metadata``,
    ``index``), the object's key relative to the checkpoint, and what is wrong."""

    what: str  # the item (FQN, with its chunk offsets when sharded), "metadata" or "index"
    key: str  # object key relative to the checkpoint
    message: str


@dataclass
class VerifyReport:
    """What :func:`verify_checkpoint` read and checked (items, objects, bytes), and the
    damage it found; ``ok`` when there is none."""

    uri: str
    save_id: str
    items: int = 0
    objects: int = 0
    bytes: int = 0  # bytes read and checked
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class _Piece:
    """Whole blocks ``[start, end)`` of one item's raw bytes, and the stored bytes holding them."""

    label: str
    item: StoredItem
    start: int
    end: int

    @property
    def stored(self) -> tuple[int, int]:
        return stored_span(self.item.frames, self.item.block_size, self.start, self.end)

    @property
    def size(self) -> int:
        """Stored bytes to fetch."""
        first, last = self.stored
        return last - first


class Verifier:
    """One verification run; see the module docstring for the steps."""

    def __init__(
        self, store: ObjectStore, location: S3URI, manifest: Manifest, max_buffer: int
    ) -> None:
        self.store, self.location, self.manifest = store, location, manifest
        self.max_buffer = max_buffer
        self.report = VerifyReport(str(location), manifest.save_id, manifest.item_count)
        self._reported: set[tuple[str, str]] = set()
        self.items: tuple[ItemEntry, ...] = manifest.items

    def problem(self, what: str, key: str, message: str) -> None:
        if (what, key) not in self._reported:  # one line per damaged item
            self._reported.add((what, key))
            self.report.problems.append(Problem(what, key, message))

    def run(self, progress: Reporter) -> VerifyReport:
        sizes = io_loop().run(self._sizes())
        manifest = self.manifest
        self.report.objects = len(manifest.objects) + len(manifest.indexes) + 1
        self._check_metadata(sizes)
        if not manifest.items_listed:
            self.items = io_loop().run(self._indexed_items())
        batches = list(_batches(list(self._pieces(sizes)), self.max_buffer))
        total = [sum(p.size for p in batch) for batch in batches]
        # One buffer for all batches. Reusing it is safe: Downloader.fetch returns, or
        # raises, only after every request of the batch has finished.
        buffer = memoryview(bytearray(max(total, default=0)))
        progress.start("verifying", sum(total), "bytes")
        for batch in batches:
            self._fetch(batch, buffer, progress)
        progress.finish()
        return self.report

    async def _sizes(self) -> dict[str, int]:
        prefix = self.location.key("")
        metas: list[ObjectMeta] = [m async for m in self.store.list(prefix)]
        return {m.key[len(prefix) :]: m.size for m in metas}

    def _check_metadata(self, sizes: dict[str, int]) -> None:
        key, manifest = self.manifest.metadata_key, self.manifest
        if sizes.get(key) != manifest.metadata_size:
            found = "missing" if key not in sizes else f"{sizes[key]} bytes"
            self.problem("metadata", key, f"{found}, the manifest says {manifest.metadata_size}")
            return
        size, crc = manifest.metadata_size, manifest.metadata_crc32c
        try:
            io_loop().run(get_intact(self.store, self.location.key(key), size, crc, key))
        except CorruptCheckpointError:
            self.problem("metadata", key, "checksum mismatch")
        self.report.bytes += manifest.metadata_size

    async def _indexed_items(self) -> tuple[ItemEntry, ...]:
        """Format 2: the items of every rank whose index object is intact."""
        items: list[ItemEntry] = []
        refs = list(self.manifest.indexes)
        for ref, index in zip(
            refs, await read_each(self.store, self.location, self.manifest, refs), strict=True
        ):
            if isinstance(index, RankIndex):
                self.report.bytes += ref.size
                items.extend(index.items)
                continue
            self.problem(
                "index", ref.key, f"{_why(index)}: {ref.items} items of rank {ref.rank} unchecked"
            )
        return tuple(items)

    def _pieces(self, sizes: dict[str, int]) -> Iterator[_Piece]:
        recorded = {o.key: o.size for o in self.manifest.objects}
        for entry in self.items:
            item, label = entry.stored, entry.label
            size = sizes.get(item.key)
            blocks = -(-item.size // item.block_size) if item.size else 1
            if item.key not in recorded:
                self.problem(label, item.key, "its object is not in the manifest's object list")
            elif size is None:
                self.problem(label, item.key, "object missing")
            elif size != recorded[item.key]:
                self.problem(
                    label, item.key, f"object is {size} bytes, expected {recorded[item.key]}"
                )
            elif item.offset + item.length > size:
                self.problem(label, item.key, f"item runs past the end of its {size}-byte object")
            elif len(item.crc32c) != blocks:
                self.problem(label, item.key, f"{len(item.crc32c)} checksums for {blocks} blocks")
            elif (
                item.length == 0 and first_bad_block(memoryview(b""), item.crc32c, 1, 0) is not None
            ):
                self.problem(label, item.key, "checksum mismatch (empty item)")
            elif item.codec not in CODECS or (item.codec != RAW and len(item.frames) != blocks):
                self.problem(label, item.key, f"unknown codec {item.codec!r} or frame table")
            if size is None or item.length == 0 or (label, item.key) in self._reported:
                continue
            piece = min(_PIECE, self.max_buffer) // item.block_size * item.block_size
            step = max(item.block_size, piece)
            for start in range(0, item.size, step):
                yield _Piece(label, item, start, min(start + step, item.size))

    def _fetch(self, batch: list[_Piece], buffer: memoryview, progress: Reporter) -> None:
        """Read and check a batch, retrying without an object that fails to read."""
        pending = set(range(len(batch)))
        while pending:
            targets, offset = [], 0
            for index in sorted(pending):
                piece = batch[index]
                view, offset = buffer[offset : offset + piece.size], offset + piece.size
                start = piece.item.offset + piece.stored[0]
                key = self.location.key(piece.item.key)
                targets.append(ReadTarget(key, start, start + piece.size, view, index))
            views = {t.token: t.buffer for t in targets}
            try:
                for token in Downloader(self.store).fetch(targets):
                    pending.discard(token)  # type: ignore[arg-type]
                    self._check(batch[token], views[token], progress)  # type: ignore[index]
            except StorageError as exc:
                failed = {i for i in pending if self.location.key(batch[i].item.key) == exc.key}
                for index in failed or pending:
                    piece = batch[index]
                    self.problem(piece.label, piece.item.key, f"read failed: {exc}")
                pending -= failed or set(pending)

    def _check(self, piece: _Piece, data: memoryview, progress: Reporter) -> None:
        damage = _damage(piece, data)
        for _ in range(REREADS if damage else 0):  # damage in transit goes away on a re-read
            damage = _damage(piece, self._read_again(piece))
            if damage is None:
                break
        if damage is not None:
            self.problem(piece.label, piece.item.key, damage)
        self.report.bytes += piece.size
        progress.advance(piece.size)

    def _read_again(self, piece: _Piece) -> memoryview:
        """The piece's stored bytes, read anew on fresh connections."""
        view = memoryview(bytearray(piece.size))
        start = piece.item.offset + piece.stored[0]
        target = ReadTarget(self.location.key(piece.item.key), start, start + piece.size, view, 0)
        Downloader(self.store).fetch_again([target])
        return view


def _damage(piece: _Piece, data: memoryview) -> str | None:
    """What is wrong with a piece's bytes (undecodable, a block's CRC32C), or None."""
    item = piece.item
    try:
        raw = _decoded(piece, data)
    except CorruptCheckpointError as exc:
        return str(exc)
    block = first_bad_block(raw, item.crc32c, item.block_size, piece.start // item.block_size)
    if block is None:
        return None
    start = item.offset + block * item.block_size
    end = item.offset + min((block + 1) * item.block_size, item.length)
    return f"checksum mismatch in block {block} (object bytes {start}-{end})"


def _decoded(piece: _Piece, data: memoryview) -> memoryview:
    """The raw bytes of a piece: the data itself, or its frames decoded."""
    item = piece.item
    if item.codec == RAW:
        return data
    raw = memoryview(bytearray(piece.end - piece.start))
    first_block, position = piece.start // item.block_size, 0
    for n, start in enumerate(range(0, len(raw), item.block_size)):
        size = item.frames[first_block + n]
        decode_block(
            data[position : position + size], item.codec, raw[start : start + item.block_size]
        )
        position += size
    return raw


def _batches(pieces: list[_Piece], budget: int) -> Iterator[list[_Piece]]:
    batch: list[_Piece] = []
    used = 0
    for piece in pieces:
        if batch and used + piece.size > budget:
            yield batch
            batch, used = [], 0
        batch.append(piece)
        used += piece.size
    if batch:
        yield batch


def verify_checkpoint(
    uri: str | S3URI,
    *,
    max_buffer: int = DEFAULT_MAX_BUFFER,
    progress: Reporter = SILENT,
    config: S3Config | None = None,
    **options: Any,
) -> VerifyReport:
    """Re-read and check the committed checkpoint at ``uri``; damage is reported, not raised.

    Args:
        uri: the checkpoint, ``s3://bucket/prefix`` (a prefix is required).
        max_buffer: bytes read ahead and held at most (at least one checksum block).
        progress: told how many bytes are checked as they go (the CLI's progress bar).
        config: connection and tuning (:class:`~s3ckpt.S3Config`; the defaults when None).
        **options: :class:`~s3ckpt.S3Config`'s fields by name, over ``config``.

    Returns:
        What was read and checked, and every :class:`Problem` found (``ok`` when none).

    Raises:
        ~s3ckpt.errors.CheckpointNotFoundError: nothing is committed at ``uri``.
        ~s3ckpt.errors.ForeignObjectError: the ``manifest.json`` there is not s3ckpt's.
        ~s3ckpt.errors.CorruptCheckpointError: the manifest itself is unreadable (damage
            to anything it names is reported instead).
        ~s3ckpt.errors.InvalidURIError: ``uri`` is not an ``s3://bucket/prefix`` URI.
        ~s3ckpt.errors.ConfigError: an unknown or invalid option.
        ~s3ckpt.errors.StorageError: the manifest's GET or the listing failed (a missing
            bucket: :class:`~s3ckpt.errors.BucketNotFoundError`).
    """
    store, location = open_store(uri, config, options, require_prefix=True)
    manifest = io_loop().run(read_committed(store, location))
    return Verifier(store, location, manifest, max_buffer).run(progress)


def _why(error: BaseException) -> str:
    """What went wrong with an index object, as a verify problem says it."""
    if isinstance(error, FileNotFoundError):
        return "missing"
    if isinstance(error, CorruptCheckpointError):
        return str(error)
    return f"read failed: {error}"
