"""Block CRC32C checksums of item bytes: computing them and checking reads against them.

An item's bytes are checksummed per ``block_size`` block (the last block may be shorter;
an empty item has one CRC of no bytes), so a read of any block-aligned sub-range can be
verified on its own. CRC32C runs in native code that releases the GIL over large buffers
(:func:`crc_of`). Torch-free, so the CLI can verify without importing torch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from crc32c import crc32c

from s3ckpt.errors import CorruptCheckpointError

try:  # the same arithmetic in C (:func:`combine`)
    from s3ckpt.format._byteplanes import crc32c_combine as _native_combine
except ImportError:  # pragma: no cover - exercised where no C compiler is available
    _native_combine = None
try:  # many buffers' block CRC32Cs in one native pass (:func:`block_crcs_of_each`)
    from s3ckpt.format._byteplanes import CRC32C_AVAILABLE
    from s3ckpt.format._byteplanes import block_crcs as _native_block_crcs
except ImportError:  # pragma: no cover - exercised where no C compiler is available (or no x86-64)
    CRC32C_AVAILABLE, _native_block_crcs = False, None
if not CRC32C_AVAILABLE:  # pragma: no cover - a CPU without SSE4.2
    _native_block_crcs = None

# Below this many bytes a CRC32C keeps the GIL: it takes less time than releasing and
# retaking the GIL costs a thread beside a training loop (thread mode), a wait for the loop
# to let it go, and the loop a wait in turn (docs/decisions/0008-thread-mode-gil.md).
_KEEP_GIL_BELOW = 256 << 10


def crc_of(data: bytes | memoryview, crc: int = 0) -> int:
    """The CRC32C of ``data`` continuing ``crc``; the GIL is released for large buffers only."""
    return crc32c(data, crc, gil_release_mode=0 if len(data) < _KEEP_GIL_BELOW else 1)


def block_crcs(data: memoryview, block_size: int) -> tuple[int, ...]:
    """One CRC32C per ``block_size`` block of ``data``."""
    return block_crcs_of_each([data], block_size)[0]


def block_crcs_of_each(datas: Sequence[memoryview], block_size: int) -> list[tuple[int, ...]]:
    """:func:`block_crcs` of each buffer (bytes, or byte-format memoryviews: blocks are
    counted in bytes), all of them in one native pass where the format's native module is
    built: the GIL is released once for every block of every buffer (kept where they hold
    fewer than :data:`_KEEP_GIL_BELOW` bytes in all).

    A thread-mode save's items come here a run at a time (:class:`~s3ckpt.format.compression.
    RawRuns`): one call per item would hold the GIL over every small item's bytes
    and hand it over once per block of a large one (docs/decisions/0008-thread-mode-gil.md).
    """
    if _native_block_crcs is not None:
        return _native_block_crcs(datas, block_size, _KEEP_GIL_BELOW)
    return [_block_crcs_python(data, block_size) for data in datas]


def _block_crcs_python(data: memoryview, block_size: int) -> tuple[int, ...]:
    if block_size < 1:
        raise ValueError("block_size must be positive")
    if len(data) == 0:
        return (crc32c(b""),)
    return tuple(crc_of(data[i : i + block_size]) for i in range(0, len(data), block_size))


def range_crc(
    blocks: tuple[int, ...], block_size: int, length: int, start: int, end: int
) -> int | None:
    """The CRC32C of bytes ``[start, end)`` of an item from its block CRCs, if the range is
    made of whole blocks (the last may be the item's short last block); else ``None``.

    Lets a multipart part cut on block boundaries carry its CRC32C without a second pass
    over its bytes.
    """
    if start % block_size or (end % block_size and end != length) or not start < end <= length:
        return None
    first, last = start // block_size, -(-end // block_size)
    crc = blocks[first]
    for block in range(first + 1, last):
        crc = combine(crc, blocks[block], min(block_size, length - block * block_size))
    return crc


_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC32C of ``A + B`` from ``crc1 = CRC(A)``, ``crc2 = CRC(B)`` and ``len(B)``.

    zlib's ``crc32_combine`` for the Castagnoli polynomial: ``crc1`` times ``x^(8 len2)``
    modulo the polynomial, plus ``crc2``, instead of a pass over B. In C where the format's
    native module is built (a save makes hundreds of these on the thread beside the loop);
    the Python below is the fallback, and the reference the C is tested against.
    """
    if _native_combine is not None:
        return _native_combine(crc1, crc2, length2)
    return _combine_python(crc1, crc2, length2)


def _combine_python(crc1: int, crc2: int, length2: int) -> int:
    if not (0 <= crc1 <= 0xFFFFFFFF and 0 <= crc2 <= 0xFFFFFFFF):
        raise ValueError("CRC32C values are 32-bit")
    if length2 < 0:
        raise ValueError("lengths are not negative")
    if crc1 == 0:  # A is empty (or CRCs to zero): shifting zero gives zero
        return crc2
    return _multiply(_shift(length2), crc1) ^ crc2


def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial (bit-reflected)."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


# x^(2^k) modulo the Castagnoli polynomial repeats every 31 steps (x^(2^31) = x), not
# every 32 as for zlib's CRC-32 polynomial, whose ``k & 31`` indexing cannot be copied:
# it picked the wrong power for lengths of 2^29 bytes (512 MiB) and more.
_CYCLE = 31


def _powers() -> list[int]:
    """``x^(2^k)`` modulo the polynomial, k = 0..30."""
    powers, power = [], 1 << 30  # x^1
    for _ in range(_CYCLE):
        powers.append(power)
        power = _multiply(power, power)
    return powers


_X2N = _powers()


@functools.lru_cache(maxsize=256)
def _shift(length: int) -> int:
    """``x^(8 length)`` modulo the polynomial."""
    power, k, n = 1 << 31, 3, length  # x^0
    while n:
        if n & 1:
            power = _multiply(_X2N[k % _CYCLE], power)
        n >>= 1
        k += 1
    return power


def first_bad_block(
    data: memoryview, expected: tuple[int, ...], block_size: int, first: int
) -> int | None:
    """The first block of ``data`` (block ``first`` of its item) whose CRC32C is wrong, if any."""
    if len(data) == 0:
        return None if expected and expected[0] == crc32c(b"") else 0
    for n, start in enumerate(range(0, len(data), block_size)):
        block = first + n
        if block >= len(expected) or crc_of(data[start : start + block_size]) != expected[block]:
            return block
    return None


def verify_blocks(
    data: memoryview, expected: tuple[int, ...], *, block_size: int, first_block: int, what: str
) -> None:
    """Raise :class:`CorruptCheckpointError` naming ``what`` if any block of ``data`` is wrong."""
    block = first_bad_block(data, expected, block_size, first_block)
    if block is not None:
        raise mismatch(what, block, first_block, block_size, len(data))


def check_block(
    crc: int, expected: tuple[int, ...], block: int, *, first_block: int, block_size: int,
    length: int, what: str,
) -> None:  # fmt: skip
    """Raise unless ``crc``, computed over block ``block`` of a read of ``length`` bytes
    starting at block ``first_block``, is the expected one."""
    if block >= len(expected) or expected[block] != crc:
        raise mismatch(what, block, first_block, block_size, length)


def mismatch(
    what: str, block: int, first_block: int, block_size: int, length: int
) -> CorruptCheckpointError:
    start = (block - first_block) * block_size
    end = min(start + block_size, length)
    return CorruptCheckpointError(
        f"checksum mismatch in {what} (block {block}, bytes {start}-{end} of the read)"
    )


class StreamingCheck:
    """Verifies an item range's block CRC32Cs while its bytes stream in.

    The range starts at a block boundary of its item (block ``first_block``). Bytes may
    arrive from several responses in any order, but each block's bytes must arrive in
    order, which holds when every block lies within one response: the download planner
    guarantees it or calls :meth:`disable`, and the caller then checks the whole buffer
    after the fact with :func:`verify_blocks`. Checking bytes just received, while they
    are still in the CPU cache, saves a second pass over memory.
    """

    def __init__(
        self, expected: tuple[int, ...], block_size: int, first_block: int, length: int
    ) -> None:
        self.expected = expected
        self.block_size = block_size
        self.first_block = first_block
        self.length = length
        self.active = True
        self.bad_block: int | None = None
        self._running: dict[int, tuple[int, int]] = {}  # block -> (crc so far, bytes so far)

    def disable(self) -> None:
        self.active = False

    def feed(self, position: int, data: memoryview) -> None:
        """Account for ``data`` found at ``position`` (relative to the start of the range)."""
        while self.active and len(data):
            block, within = divmod(position, self.block_size)
            take = min(len(data), self.block_size - within)
            crc, filled = self._running.pop(block, (0, 0))
            if filled != within:  # out of order: leave it to verify_blocks
                self.disable()
                return
            crc = crc_of(data[:take], crc)
            filled += take
            if filled == self.block_size or position + take == self.length:
                self._check(block, crc)
            else:
                self._running[block] = (crc, filled)
            position += take
            data = data[take:]

    def _check(self, block: int, crc: int) -> None:
        index = self.first_block + block
        if self.bad_block is None and (index >= len(self.expected) or self.expected[index] != crc):
            self.bad_block = index
