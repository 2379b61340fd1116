"""Copies sent between checkpoint processes (``s3ckpt.background.replicate``): received
piece by piece into the receiver's tmpfs files, each region checked against the sender's
CRC32C as its pieces land, the descriptor written only for a copy that arrived intact;
and a restore's fetch, received straight into the model's memory (``ReceiveIntoModel``)."""

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


def sent_bytes(tmp_path, segment: int, offset: int, nbytes: int) -> str:
    data = (tmp_path / "sender" / f"segment-{segment}").read_bytes()
    return data[offset : offset + nbytes].hex()


def test_a_fetch_lands_in_the_target_and_in_memory_checked(tmp_path):
    reports = run(tmp_path, "into")
    assert reports[0] == {"ok": True}
    got = reports[1]
    assert got["problem"] is None and got["check"] is None
    assert got["in target"] == sent_bytes(tmp_path, *rank_side.REGIONS[0])
    assert got["in memory"] == [sent_bytes(tmp_path, *r) for r in rank_side.REGIONS[1:]]


def test_a_fetch_damaged_on_the_way_is_found_where_it_landed(tmp_path):
    reports = run(tmp_path, "into damaged")  # a byte of region 0, received into the target
    assert reports[0] == {"ok": True}
    assert "arrived damaged (segment 0, bytes 0..10000)" in reports[1]["check"]


def test_a_fetch_never_asked_for_is_not_sent_and_nobody_waits(tmp_path):
    reports = run(tmp_path, "into refused")
    assert reports == [{"ok": True}, {"problem": None}]
