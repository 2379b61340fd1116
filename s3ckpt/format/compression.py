"""Optional zstd compression of item bytes, per checksum block, with byte grouping.

Each item is cut into the same blocks its checksums use (8 MiB of raw bytes); each block
becomes one independently decodable frame, so a ranged or resharded load fetches and
decodes only the blocks it needs. CRC32Cs stay over the *raw* bytes, so verification
covers compression too.

Byte grouping (codec ``zstd-bg``) applies to floating-point items: the bytes of each
element are split into planes (for bf16 the low mantissa bytes, then the sign and
exponent bytes), so the highly repetitive exponent bytes sit together and compress well,
while the near-random mantissa planes are detected with a small probe and stored as they
are instead of being pushed through zstd for nothing. Frames of grouped blocks are::

    itemsize (1 byte), then per plane: mode (1 byte: 0 raw, 1 zstd), length (4 bytes LE),
    then the plane payloads in order

An item whose encoding saves less than ``min_saving`` is stored raw (codec ``raw``).
zstd and the byte-plane split (:mod:`s3ckpt.format.byteplanes`) release the GIL, so a
:class:`Compressor` compresses several items at once in worker threads, ahead of the
upload, within a bound on buffered bytes.
"""

from __future__ import annotations

import struct
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

import zstandard
from crc32c import crc32c

from s3ckpt.errors import ConfigError, CorruptCheckpointError
from s3ckpt.format import byteplanes
from s3ckpt.format.checksums import block_crcs, block_crcs_of_each
from s3ckpt.format.layout import DEFAULT_BLOCK_SIZE

T = TypeVar("T")
RAW, ZSTD, ZSTD_GROUPED = "raw", "zstd", "zstd-bg"
CODECS = (RAW, ZSTD, ZSTD_GROUPED)
_PROBE = 64 * 1024


@dataclass(frozen=True)
class Compression:
    """``compression=`` option of :class:`~s3ckpt.S3StorageWriter`.

    level: zstd level (1 is fast and, with byte grouping, nearly as small as higher ones).
    byte_grouping: group bytes of floating-point items by significance before zstd.
    min_saving: store an item raw unless its encoding is at least this fraction smaller.
    threads: worker threads compressing ahead of the upload.
    max_ahead: raw bytes being compressed or waiting for the upload, at most; also the
        bound on compressed bytes handed to the upload and not yet sent (they are memory
        an uncompressed save does not hold), instead of ``max_bytes_in_flight``.
    """

    level: int = 1
    byte_grouping: bool = True
    min_saving: float = 0.02
    threads: int = 2
    max_ahead: int = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        if not -7 <= self.level <= 22:
            raise ConfigError(f"zstd level must be between -7 and 22, got {self.level}")
        if not 0 <= self.min_saving < 1 or self.threads < 1 or self.max_ahead < 1:
            raise ConfigError("min_saving must be in [0, 1), threads and max_ahead positive")

    @classmethod
    def parse(
        cls, option: str | Compression | None, level: int | None = None
    ) -> Compression | None:
        """``None``/``"none"`` (off), ``"zstd"``, or a :class:`Compression`."""
        if option is None or option == "none":
            return None
        if isinstance(option, Compression):
            return option
        if option == "zstd":
            return cls() if level is None else cls(level=level)
        raise ConfigError(f"compression must be None, 'none' or 'zstd', got {option!r}")


@dataclass(frozen=True)
class Encoded:
    """An item as stored: its bytes, codec, frame sizes and raw-block checksums."""

    payload: memoryview
    codec: str
    raw_length: int
    crc32c: tuple[int, ...]
    frames: tuple[int, ...] = ()


def encode_raw(data: memoryview, block_size: int = DEFAULT_BLOCK_SIZE) -> Encoded:
    return Encoded(data, RAW, len(data), block_crcs(data, block_size))


# Bytes of items checksummed together by :class:`RawRuns`: small enough that the items
# resolved ahead of their upload stay a small fraction of the bytes in flight, large enough
# that runs of small items cost one GIL hand-over per few dozen items.
RUN_BYTES = 4 << 20


class RawRuns(Generic[T]):
    """:func:`encode_raw` of items added one by one, in order, a run of :data:`RUN_BYTES`
    at a time: each run's block CRC32Cs come from one native pass that releases the GIL
    once (:func:`~s3ckpt.format.checksums.block_crcs_of_each`), rather than keep it over
    every small item and hand it over per block of a large one. The caller resolves each
    item as it adds it and :meth:`take` s the run once :meth:`add` says it is full (and
    the last, partial one at the end), so items are resolved no further ahead than their
    run.
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.block_size = block_size
        self._run: list[tuple[T, memoryview]] = []
        self._size = 0

    def add(self, key: T, data: memoryview) -> bool:
        """Add ``(key, data)`` to the run; whether the run is full (take it now)."""
        self._run.append((key, data))
        self._size += len(data)
        return self._size >= RUN_BYTES

    def take(self) -> Iterator[tuple[T, Encoded]]:
        """The run's items, encoded in order, each made as it is taken (a run of small
        items is thousands of them); the next run starts empty."""
        run, self._run, self._size = self._run, [], 0
        if not run:
            return iter(())
        crcs = block_crcs_of_each([data for _, data in run], self.block_size)
        return (
            (key, Encoded(data, RAW, len(data), item_crcs))
            for (key, data), item_crcs in zip(run, crcs, strict=True)
        )


def encode(
    data: memoryview, grouping: int, options: Compression, block_size: int = DEFAULT_BLOCK_SIZE
) -> Encoded:
    """Compress ``data`` block by block; ``grouping`` is the element size to group by (0: none)."""
    if not data:
        return encode_raw(data, block_size)
    codec = ZSTD_GROUPED if grouping > 1 and options.byte_grouping else ZSTD
    compressor = _compressor(options.level, grouped=codec == ZSTD_GROUPED)
    blocks = [data[i : i + block_size] for i in range(0, len(data), block_size)]
    if codec == ZSTD_GROUPED:
        # The split reads each block anyway: it checksums it in the same pass.
        encoded = [_group_and_compress(block, grouping, compressor) for block in blocks]
        frames = [frame for frame, _ in encoded]
        crcs = tuple(crc for _, crc in encoded)
    else:
        crcs = block_crcs(data, block_size)
        frames = [compressor.compress(block) for block in blocks]
    stored = sum(len(f) for f in frames)
    if stored > len(data) * (1 - options.min_saving):
        return Encoded(data, RAW, len(data), crcs)
    return Encoded(
        memoryview(b"".join(frames)), codec, len(data), crcs, tuple(len(f) for f in frames)
    )


def decode_block(frame: memoryview, codec: str, out: memoryview) -> int:
    """Decode one frame into ``out`` (exactly the block's raw size); the CRC32C of ``out``.

    The checksum is computed while decoding, so that checking a block against the
    manifest's CRC32C costs no second pass over its bytes.
    """
    try:
        if codec == ZSTD:
            block = _decompressor().decompress(frame, max_output_size=len(out))
            out[:] = block
            return crc32c(block)
        if codec == ZSTD_GROUPED:
            return _ungroup(frame, out)
        raise CorruptCheckpointError(f"unknown codec {codec!r}")
    except (zstandard.ZstdError, ValueError, struct.error) as exc:
        raise CorruptCheckpointError(f"undecodable {codec} frame: {exc}") from exc


class Compressor(Generic[T]):
    """:func:`encode` of items in worker threads, ahead of the upload, results taken in
    order, with at most ``options.max_ahead`` raw bytes in the pipeline. The caller owns
    the loop: before it :meth:`submit` s an item, it :meth:`take` s results while
    :meth:`full` says the item does not fit. Use as a context manager (the threads)."""

    def __init__(self, options: Compression, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.options = options
        self.block_size = block_size
        self._pending: deque[tuple[T, int, Future[Encoded]]] = deque()
        self._ahead = 0
        self._pool = ThreadPoolExecutor(options.threads, thread_name_prefix="s3ckpt-zstd")

    def __enter__(self) -> Compressor[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._pool.shutdown(wait=True)

    @property
    def pending(self) -> int:
        """Items submitted and not taken yet."""
        return len(self._pending)

    def full(self, nbytes: int) -> bool:
        """Whether an item of ``nbytes`` must wait for a result to be taken first: some
        are pending, and it would take the pipeline past ``max_ahead`` raw bytes."""
        return bool(self._pending) and self._ahead + nbytes > self.options.max_ahead

    def submit(self, key: T, data: memoryview, grouping: int) -> None:
        """Start compressing ``data`` (``grouping``: the element size to group by, 0: none)."""
        future = self._pool.submit(encode, data, grouping, self.options, self.block_size)
        self._pending.append((key, len(data), future))
        self._ahead += len(data)

    def take(self) -> tuple[T, Encoded]:
        """The oldest pending item's ``(key, encoding)``, once compressed."""
        key, size, future = self._pending.popleft()
        self._ahead -= size
        return key, future.result()


# -- byte grouping --------------------------------------------------------------------------

_local = threading.local()


def _compressor(level: int, *, grouped: bool) -> zstandard.ZstdCompressor:
    """A per-thread compressor (zstd contexts are not shareable between threads)."""
    key = (level, grouped)
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if key not in cache:
        if grouped and level <= 1:
            # A tiny hash table and long minimum matches: faster *and* smaller than level
            # 1's defaults on exponent planes (docs/decisions/0010-byte-grouped-compression.md).
            params = zstandard.ZstdCompressionParameters(
                strategy=zstandard.STRATEGY_FAST,
                min_match=7,
                hash_log=6,
                window_log=20,
                search_log=1,
            )
            cache[key] = zstandard.ZstdCompressor(compression_params=params)
        else:
            cache[key] = zstandard.ZstdCompressor(level=level)
    return cache[key]


def _decompressor() -> zstandard.ZstdDecompressor:
    """A per-thread decompressor: creating a zstd context per frame costs more than small
    frames take to decode."""
    decompressor = getattr(_local, "decompressor", None)
    if decompressor is None:
        decompressor = _local.decompressor = zstandard.ZstdDecompressor()
    return decompressor


def _group_and_compress(
    block: memoryview, itemsize: int, compressor: zstandard.ZstdCompressor
) -> tuple[bytes, int]:
    """The frame of a block, and the block's CRC32C."""
    grouped, crc = byteplanes.split_crc(block, itemsize)
    count = len(block) // itemsize
    header = [struct.pack("<B", itemsize)]
    payloads = []
    for plane_index in range(itemsize):
        plane = grouped[plane_index * count : (plane_index + 1) * count]
        mode, payload = _compress_plane(plane, compressor)
        header.append(struct.pack("<BI", mode, len(payload)))
        payloads.append(payload)
    return b"".join(header + payloads), crc


def _compress_plane(
    view: memoryview, compressor: zstandard.ZstdCompressor
) -> tuple[int, bytes | memoryview]:
    """zstd unless a probe of the plane's start shows it will not shrink."""
    if len(view) > _PROBE and len(compressor.compress(view[:_PROBE])) > 0.97 * _PROBE:
        return 0, view
    packed = compressor.compress(view)
    return (1, packed) if len(packed) < len(view) else (0, view)


def _ungroup(frame: memoryview, out: memoryview) -> int:
    itemsize = frame[0]
    count = len(out) // itemsize
    planes: list[bytes | memoryview] = []
    position = 1 + 5 * itemsize
    for plane_index in range(itemsize):
        mode, length = struct.unpack_from("<BI", frame, 1 + 5 * plane_index)
        payload = frame[position : position + length]
        position += length
        plane = _decompressor().decompress(payload, max_output_size=count) if mode == 1 else payload
        if len(plane) != count:
            raise ValueError(f"plane {plane_index} has {len(plane)} bytes, expected {count}")
        planes.append(plane)
    return byteplanes.merge_crc(planes, out)
