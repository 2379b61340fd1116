"""``ObjectWriter``: an object written front to back in irregular pieces arrives whole,
with the block CRC32Cs an index records, and a given-up object leaves no upload open."""

from __future__ import annotations

import os

import pytest
from s3_servers import ON_BOTH

from s3ckpt.format.checksums import block_crcs
from s3ckpt.s3.loop import io_loop
from s3ckpt.transfer.object_writer import ObjectWriter

pytestmark = [ON_BOTH]
MiB = 1024 * 1024


def _key(s3_prefix: str, name: str) -> str:
    return f"{s3_prefix.split('/', 3)[3]}/{name}"


@pytest.mark.parametrize("ahead", [0, 2])
def test_pieces_become_one_object_with_its_block_checksums(
    store, s3_prefix, pending_uploads, ahead
):
    data = os.urandom(23 * MiB + 12345)
    writer = ObjectWriter(
        store, _key(s3_prefix, "f"), part_size=5 * MiB, block_size=MiB, ahead=ahead
    )
    at = 0
    for size in [1, 7 * MiB, 3, MiB - 3, 9 * MiB + 17]:
        writer.write(memoryview(data)[at : at + size])
        at += size
    writer.write(data[at:])
    written = writer.close()
    assert io_loop().run(store.get(written.key)) == data
    assert written.size == len(data)
    assert written.block_crcs == block_crcs(memoryview(data), MiB)
    assert pending_uploads(s3_prefix) == []


def test_an_object_smaller_than_a_part_is_one_put(store, s3_prefix):
    writer = ObjectWriter(store, _key(s3_prefix, "small"), part_size=5 * MiB, block_size=MiB)
    writer.write(b"abc")
    written = writer.close()
    assert io_loop().run(store.get(written.key)) == b"abc"
    assert written.block_crcs == block_crcs(memoryview(b"abc"), MiB)


def test_an_empty_object(store, s3_prefix):
    written = ObjectWriter(store, _key(s3_prefix, "empty")).close()
    assert io_loop().run(store.get(written.key)) == b""
    assert written.size == 0 and written.block_crcs == block_crcs(memoryview(b""), MiB)


def test_an_abandoned_object_leaves_no_upload_and_no_object(store, s3_prefix, pending_uploads):
    writer = ObjectWriter(store, _key(s3_prefix, "gone"), part_size=5 * MiB, block_size=MiB)
    writer.write(os.urandom(12 * MiB))  # two parts sent
    writer.abort()
    assert pending_uploads(s3_prefix) == []
    assert not io_loop().run(store.exists(_key(s3_prefix, "gone")))
