"""Checked whole-object reads: a body that fails its check is read again, up to the
re-reads allowed, and the damage raised as found once they are spent."""

from __future__ import annotations

import asyncio
import logging

import pytest
from crc32c import crc32c

from s3ckpt.errors import CorruptCheckpointError
from s3ckpt.transfer.checked import Rereads, get_intact, intact

BODY = b"the metadata object"


class Bodies:
    """A store whose GETs return the given bodies in turn, the last one from then on."""

    def __init__(self, *bodies: bytes) -> None:
        self.bodies = list(bodies)
        self.gets: list[str] = []

    async def get(self, key: str) -> bytes:
        self.gets.append(key)
        return self.bodies.pop(0) if len(self.bodies) > 1 else self.bodies[0]


def test_an_intact_body_passes_and_a_damaged_one_says_why():
    assert intact(BODY, len(BODY), crc32c(BODY), "m") is BODY
    with pytest.raises(CorruptCheckpointError, match="m has 4 bytes, the manifest says 19"):
        intact(b"torn", len(BODY), crc32c(BODY), "m")
    flipped = b"T" + BODY[1:]
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in m"):
        intact(flipped, len(BODY), crc32c(BODY), "m")


def test_rereads_are_allowed_then_the_damage_is_raised(caplog):
    tries = Rereads(2)
    damage = CorruptCheckpointError("checksum mismatch in m")
    with caplog.at_level(logging.WARNING, logger="s3ckpt.transfer.checked"):
        tries.reread_or_raise(damage)
        tries.reread_or_raise(damage)
        with pytest.raises(CorruptCheckpointError) as info:
            tries.reread_or_raise(damage)
    assert info.value is damage
    assert [r.getMessage() for r in caplog.records] == [
        "checksum mismatch in m; reading it again (1 of 2)",
        "checksum mismatch in m; reading it again (2 of 2)",
    ]


def test_damage_in_transit_is_cured_by_a_reread():
    store = Bodies(b"X" + BODY[1:], BODY)
    body = asyncio.run(get_intact(store, "k", len(BODY), crc32c(BODY), "m"))  # type: ignore[arg-type]
    assert body == BODY and store.gets == ["k", "k"]


def test_damage_on_every_read_is_raised_after_the_rereads():
    store = Bodies(b"X" + BODY[1:])
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in m"):
        asyncio.run(get_intact(store, "k", len(BODY), crc32c(BODY), "m", rereads=3))  # type: ignore[arg-type]
    assert store.gets == ["k"] * 4  # the first read, then every re-read
