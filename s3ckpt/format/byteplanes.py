"""Byte planes of fixed-size elements: the byte grouping of compressed checkpoints.

:func:`split` puts byte ``p`` of every element into plane ``p`` (planes one after another
in one buffer); :func:`merge` is its inverse. Loading a byte-grouped checkpoint merges
every byte of it, so this sits on the decode path of compressed loads.
:func:`split_crc` and :func:`merge_crc` also return the CRC32C of the element bytes, which
both directions need (checksums cover the raw bytes), computed in the same pass.

Both run in the C module ``s3ckpt.format._byteplanes`` when it is built (``pip install`` builds it
where a C compiler is available): one pass over memory, without the GIL, about twice as
fast as numpy, which needs a gather per plane to split and two passes (shift, OR) to merge
16-bit words. Without it, the numpy code below produces the same bytes. The fused
checksums need the CRC32C instruction (SSE4.2); elsewhere a separate pass computes them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
from crc32c import crc32c

try:
    from s3ckpt.format import _byteplanes as _native
except ImportError:  # pragma: no cover - exercised where no C compiler is available
    _native = None

NATIVE = _native is not None
FUSED_CRC = NATIVE and bool(getattr(_native, "CRC32C_AVAILABLE", False))
Buffer = bytes | bytearray | memoryview | np.ndarray


def split(data: Buffer, itemsize: int) -> memoryview:
    """The planes of ``data``'s ``itemsize``-byte elements, plane ``p`` at ``[p*n, (p+1)*n)``."""
    out = np.empty(memoryview(data).nbytes, dtype=np.uint8)
    if _native is not None:
        _native.split(data, itemsize, out)
    else:
        _split_numpy(data, itemsize, out)
    return memoryview(out)


def merge(planes: Sequence[Buffer], out: memoryview | np.ndarray) -> None:
    """Write elements whose byte ``p`` comes from ``planes[p]`` into ``out``."""
    if _native is not None:
        _native.merge(planes, out)
    else:
        _merge_numpy(planes, out)


def split_crc(data: Buffer, itemsize: int, crc: int = 0) -> tuple[memoryview, int]:
    """:func:`split`, and the CRC32C of ``data`` continuing ``crc``."""
    if _native is None or not FUSED_CRC:
        return split(data, itemsize), crc32c(data, crc)
    out = np.empty(memoryview(data).nbytes, dtype=np.uint8)
    return memoryview(out), _native.split_crc(data, itemsize, out, crc)


def merge_crc(planes: Sequence[Buffer], out: memoryview | np.ndarray, crc: int = 0) -> int:
    """:func:`merge`, and the CRC32C of the merged bytes continuing ``crc``.

    For large bf16/fp16 outputs the bytes are written around the CPU cache (non-temporal
    stores): a load's destination is not read again soon, and skipping the cache avoids
    reading its old contents first.
    """
    if _native is None or not FUSED_CRC:
        merge(planes, out)
        return crc32c(out, crc)
    return _native.merge_crc(planes, out, crc)


def _split_numpy(data: Buffer, itemsize: int, out: np.ndarray) -> None:
    raw = np.frombuffer(data, dtype=np.uint8)
    if itemsize < 1 or len(raw) % itemsize:
        raise ValueError(f"{len(raw)} bytes are not whole elements of {itemsize} bytes")
    out.reshape(itemsize, -1)[:] = raw.reshape(-1, itemsize).T


def _merge_numpy(planes: Sequence[Buffer], out: memoryview | np.ndarray) -> None:
    target = np.frombuffer(out, dtype=np.uint8)
    arrays = [np.frombuffer(plane, dtype=np.uint8) for plane in planes]
    count = len(target) // max(len(arrays), 1)
    if not arrays or count * len(arrays) != len(target):
        raise ValueError(f"{len(arrays)} planes cannot fill {len(target)} bytes")
    for index, plane in enumerate(arrays):
        if len(plane) != count:
            raise ValueError(f"plane {index} has {len(plane)} bytes, expected {count}")
    if len(arrays) == 2 and sys.byteorder == "little":
        # As 16-bit arithmetic, (high << 8) | low: two contiguous passes, about twice as
        # fast as writing each plane into every other byte.
        words = target.view(np.uint16)
        np.left_shift(arrays[1], 8, out=words, dtype=np.uint16)
        np.bitwise_or(words, arrays[0], out=words)
        return
    matrix = target.reshape(-1, len(arrays))
    for index, plane in enumerate(arrays):
        matrix[:, index] = plane
