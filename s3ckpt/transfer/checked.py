"""Whole-object reads whose bytes are checked, re-read when the check fails.

A checksum mismatch in a GET body is most often damage in transit (a flipped bit on a
link, a proxy), not in the store: data items are read again (:data:`REREADS` times) before
their damage is believed, and so is every other checked object, the manifest, DCP's
metadata and the rank index objects, whichever path reads it (loads, ``verify``, ``show``,
``export``, ``cp``). Damage that persists through every re-read is raised as it was found.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from crc32c import crc32c

from s3ckpt.errors import CorruptCheckpointError
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.download import REREADS

T = TypeVar("T")
log = logging.getLogger(__name__)


async def get_checked(
    store: ObjectStore, key: str, check: Callable[[bytes], T], *, rereads: int = REREADS
) -> T:
    """``check(body)`` of the object at ``key``; a body that fails it
    (:class:`CorruptCheckpointError`) is fetched again, up to ``rereads`` times."""
    for attempt in range(rereads + 1):
        body = await store.get(key)
        try:
            return check(body)
        except CorruptCheckpointError as exc:
            if attempt == rereads:
                raise
            log.warning("%s; reading it again (%d of %d)", exc, attempt + 1, rereads)
    raise AssertionError("unreachable")  # pragma: no cover


def sized_and_summed(
    expected_size: int, expected_crc32c: int, where: str
) -> Callable[[bytes], bytes]:
    """A check that a body has the size and CRC32C recorded for it."""

    def check(body: bytes) -> bytes:
        if len(body) != expected_size:
            raise CorruptCheckpointError(
                f"{where} has {len(body)} bytes, the manifest says {expected_size}"
            )
        if crc32c(body) != expected_crc32c:
            raise CorruptCheckpointError(f"checksum mismatch in {where}")
        return body

    return check
