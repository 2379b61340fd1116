"""``RankUploader``: items packed in order into objects, each item's place returned as
soon as it has one (what lets a rank build its index while the upload goes on)."""

from __future__ import annotations

import os

from s3_servers import ON_BOTH

from s3ckpt.s3.loop import io_loop
from s3ckpt.transfer.upload import Placement, RankUploader

pytestmark = [ON_BOTH]
MiB = 1024 * 1024


def test_each_place_is_reported_before_the_next_item_is_taken(store, s3_prefix, pending_uploads):
    prefix = s3_prefix.split("/", 3)[3]
    sizes = [3 * MiB, 17, 6 * MiB, MiB, 0, 4 * MiB + 5]
    bodies = [os.urandom(size) for size in sizes]
    events: list[tuple[str, int]] = []
    reported: dict[int, Placement] = {}

    def items():
        for position, body in enumerate(bodies):
            events.append(("taken", position))
            yield position, memoryview(body), None

    uploader = RankUploader(store, max_object_size=8 * MiB, size_hint=sum(sizes))
    opened: list[str] = []
    for position, data, crcs in items():
        where = uploader.add(data, crcs)
        if where is None:
            opened.append(f"{prefix}/obj-{len(opened)}")
            uploader.open(opened[-1], len(data))
            where = uploader.add(data, crcs)
        assert where is not None
        reported[position] = where
        events.append(("placed", position))
    uploaded = uploader.finish()

    assert events == [(what, n) for n in range(len(bodies)) for what in ("taken", "placed")]
    assert len(uploaded) > 1  # the 8 MiB bound split the items over objects
    assert [o.key for o in uploaded] == opened
    for position, body in enumerate(bodies):
        where = reported[position]
        stored = io_loop().run(store.get(uploaded[where.object].key))
        assert stored[where.offset : where.offset + where.length] == body
    assert pending_uploads(s3_prefix) == []
