"""Whole-object reads whose bytes are checked, re-read when the check fails.

A checksum mismatch in a GET body is most often damage in transit (a flipped bit on a
link, a proxy), not in the store: data items are read again (:data:`REREADS` times) before
their damage is believed, and so is every other checked object, the manifest, DCP's
metadata and the rank index objects, whichever path reads it (loads, ``verify``, ``show``,
``export``, ``cp``). Damage that persists through every re-read is raised as it was found.

:func:`get_intact` reads an object whose size and CRC32C are recorded. A reader whose
check is its own parsing (the manifest, a rank's index) runs the loop itself, checking
the body with :func:`intact` where it is recorded, and hands each failed check to
:class:`Rereads`, which says whether to read again: the check stays with the reader.
"""

from __future__ import annotations

import logging

from crc32c import crc32c

from s3ckpt.errors import CorruptCheckpointError
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.download import REREADS

log = logging.getLogger(__name__)


class Rereads:
    """The re-reads left for one object: each failed check is handed to
    :meth:`reread_or_raise`, which logs it and returns (read again) until ``rereads``
    re-reads were made, then raises it."""

    def __init__(self, rereads: int = REREADS) -> None:
        self.rereads = rereads
        self.made = 0

    def reread_or_raise(self, damage: CorruptCheckpointError) -> None:
        if self.made == self.rereads:
            raise damage
        self.made += 1
        log.warning("%s; reading it again (%d of %d)", damage, self.made, self.rereads)


def intact(body: bytes, expected_size: int, expected_crc32c: int, where: str) -> bytes:
    """``body``, once it has the size and CRC32C recorded for it
    (:class:`CorruptCheckpointError` if not)."""
    if len(body) != expected_size:
        raise CorruptCheckpointError(
            f"{where} has {len(body)} bytes, the manifest says {expected_size}"
        )
    if crc32c(body) != expected_crc32c:
        raise CorruptCheckpointError(f"checksum mismatch in {where}")
    return body


async def get_intact(
    store: ObjectStore,
    key: str,
    expected_size: int,
    expected_crc32c: int,
    where: str,
    *,
    rereads: int = REREADS,
) -> bytes:
    """The body of the object at ``key``, of the size and CRC32C recorded for it; one that
    is not (:class:`CorruptCheckpointError`) is fetched again, up to ``rereads`` times."""
    tries = Rereads(rereads)
    while True:
        body = await store.get(key)
        try:
            return intact(body, expected_size, expected_crc32c, where)
        except CorruptCheckpointError as exc:
            tries.reread_or_raise(exc)
