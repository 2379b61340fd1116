"""Copies sent between checkpoint processes (``s3ckpt.background.replicate``): received
piece by piece into the receiver's tmpfs files, each region checked against the sender's
CRC32C as its pieces land, the descriptor written only for a copy that arrived intact."""

from __future__ import annotations

import json

import _exchange_worker as rank_side
import pytest
from _dist_worker import run_ranks

from s3ckpt.background import held

pytestmark = pytest.mark.distributed


def run(tmp_path, fault: str = "") -> list[dict]:
    sender, receiver = tmp_path / "sender", tmp_path / "receiver"
    sender.mkdir()
    receiver.mkdir()
    (receiver / "segment-5").write_bytes(b"left from a larger copy")
    run_ranks(rank_side.exchange_main, 2, str(sender), str(receiver), fault, str(tmp_path))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_copy_arrives_whole_in_pieces_and_is_recorded(tmp_path):
    reports = run(tmp_path)
    assert reports == [{"ok": True}, {"ok": True, "held": True}]
    sent, got = held.read(tmp_path / "sender"), held.read(tmp_path / "receiver")
    assert got is not None and sent is not None
    assert got.regions == sent.regions and got.step == sent.step
    for region in sent.regions:
        want = (tmp_path / "sender" / f"segment-{region.segment}").read_bytes()
        have = (tmp_path / "receiver" / f"segment-{region.segment}").read_bytes()
        span = slice(region.offset, region.offset + region.nbytes)
        assert have[span] == want[span]
    assert not (tmp_path / "receiver" / "segment-5").exists()  # not part of this copy


def test_a_copy_damaged_on_the_way_is_not_recorded(tmp_path):
    """Both sides still meet at the end: the sender returns, the receiver raises."""
    reports = run(tmp_path, "damaged")
    assert reports[0] == {"ok": True}
    assert "arrived damaged (segment 1, bytes 4096..13096)" in reports[1]["error"]
    assert reports[1]["held"] is False


def test_a_receiver_without_room_is_not_sent_to_and_nobody_waits(tmp_path):
    """The sender is told not to send; it returns, the receiver raises, nothing is
    recorded."""
    reports = run(tmp_path, "no room")
    assert reports[0] == {"ok": True}
    assert reports[1]["error"].startswith("MemoryTierError: not enough shared memory")
    assert reports[1]["held"] is False
