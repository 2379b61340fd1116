"""The protocol between a trainer and its checkpoint process: every message crosses a real
channel as itself (its type, its fields, the descriptors of a ``Segments``), and a message
that is none of the protocol's is an error on the side that receives it."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
from typing import Any, get_args

import pytest
import torch

from s3ckpt import S3Config
from s3ckpt.background.arena import StagingArena
from s3ckpt.background.channel import Channel, ChannelClosed
from s3ckpt.background.protocol import (
    CopyFailure,
    CopyHeld,
    Failed,
    Hello,
    HoldRequest,
    Meeting,
    Ready,
    Replicated,
    Retained,
    Saved,
    SaveRequest,
    Segments,
    Stop,
    ToProcess,
    ToTrainer,
)
from s3ckpt.background.replicate import ReplicaExchange
from s3ckpt.background.trainer_side import TrainerSide, process_environment
from s3ckpt.catalog.run_retention import RunRetention
from s3ckpt.config import S3URI
from s3ckpt.errors import CheckpointProcessError, StoreStalledError


def _reply(metadata: Any) -> Any:
    """A request's ``reply``: a function the process unpickles by reference."""
    return metadata


HOLD = HoldRequest(
    folder="/mnt/tier/slot-0",
    step=7,
    rank=1,
    world=2,
    run="run-a",
    regions=((0, 0, 64), (0, 64, 32)),
    replicate=ReplicaExchange(
        sends=((0, "/mnt/tier/slot-0"),), receives=((0, "/mnt/tier/slot-1"),)
    ),
    lineage="run-a:6",
)

MESSAGES: list[Any] = [
    Hello(
        sys_path=["/opt/train", *sys.path[:2]],
        log_level=logging.DEBUG,
        meeting=Meeting("10.0.0.1", 29511, "s3ckpt-checkpoint-process/3", 1, 2, 60.0),
        config=S3Config(endpoint_url="http://127.0.0.1:9000"),
        nice=10,
        retention=RunRetention(
            S3URI("bucket", "run"), S3Config(endpoint_url="http://127.0.0.1:9000"), 2, None
        ),
    ),
    Hello(sys_path=[], log_level=logging.WARNING, meeting=None),
    SaveRequest(3, 1, b"\x80\x05state", None, None, HOLD, _reply),
    SaveRequest(4, 0, b"", None, None, None),
    SaveRequest(
        5, 0, b"", None, None, None, copy_failure=CopyFailure("step 5 not saved: rank 1 ...")
    ),
    Stop(),
    Ready(4242),
    CopyHeld(3),
    Replicated(3),
    Saved(3, {"w": torch.Size([8, 8])}),
    Saved(4, None),
    Retained(3),
]


def _cross(message: Any, fds: list[int] | None = None) -> tuple[Any, list[int]]:
    """``message`` sent over a socketpair's channel, as the other end receives it."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender, receiver = Channel(ours), Channel(theirs)
    got: list[tuple[Any, list[int]]] = []
    reader = threading.Thread(target=lambda: got.append(receiver.receive()))
    reader.start()
    try:
        sender.send(message, fds)
        reader.join(timeout=30)
    finally:
        sender.close()
        receiver.close()
    assert got, "the message never arrived"
    return got[0]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_message_crosses_the_channel_as_itself(message: Any) -> None:
    received, fds = _cross(message)
    assert type(received) is type(message) and received == message and fds == []


def test_segments_carry_their_descriptors() -> None:
    arena = StagingArena()
    try:
        arena.allocate([100])
        arena.allocate([arena.segments[0].size, 4096])  # a second segment for the rest
        arena.segments[1].view(0, 4).copy_(torch.tensor([9, 8, 7, 6], dtype=torch.uint8))
        sizes = tuple(segment.size for segment in arena.segments)
        received, fds = _cross(Segments(1, sizes), [s.fd for s in arena.segments])
        assert received == Segments(1, sizes) and len(fds) == 2
        mapped = StagingArena()
        try:
            for descriptor, size in zip(fds, received.sizes, strict=True):
                mapped.adopt(descriptor, size)
            assert mapped.segments[1].view(0, 4).tolist() == [9, 8, 7, 6]  # the same memory
        finally:
            mapped.close()
    finally:
        arena.close()


@pytest.mark.parametrize("save_id", [5, None])
def test_a_failure_crosses_with_its_error(save_id: int | None) -> None:
    error = StoreStalledError("no progress for 30 s")
    received, _ = _cross(Failed(save_id, error))
    assert type(received) is Failed and received.save_id == save_id
    assert type(received.error) is StoreStalledError and str(received.error) == str(error)


def test_every_message_of_the_protocol_is_exercised() -> None:
    """A message added to the protocol is added to these tests."""
    exercised = {type(m) for m in MESSAGES} | {Segments, Failed}
    assert exercised == set(get_args(ToProcess)) | set(get_args(ToTrainer))
    assert set(get_args(ToProcess)).isdisjoint(get_args(ToTrainer))


def _started(tmp_path: Any) -> tuple[subprocess.Popen[bytes], Channel]:
    """A checkpoint process started as the trainer starts it, and the trainer's channel."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with (tmp_path / "stderr").open("wb") as stderr:
        popen = subprocess.Popen(
            [sys.executable, "-m", "s3ckpt.background.process_side", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stderr=stderr,
            env=process_environment(),
        )
    theirs.close()
    return popen, Channel(ours)


@pytest.mark.subprocess
@pytest.mark.parametrize("when", ["before Hello", "after Ready"])
def test_the_process_fails_on_a_message_it_does_not_know(tmp_path: Any, when: str) -> None:
    """The positional tuples of old, say: the process exits with an error naming the
    message, and the trainer's end of the channel closes."""
    popen, channel = _started(tmp_path)
    try:
        if when == "after Ready":
            channel.send(Hello(list(sys.path), logging.WARNING, None))
            ready, _ = channel.receive()
            assert ready == Ready(popen.pid)
        channel.send(("stop",))
        with pytest.raises(ChannelClosed):
            channel.receive()
        assert popen.wait(timeout=60) != 0
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait()
        channel.close()
    stderr = (tmp_path / "stderr").read_text()
    assert "CheckpointProcessError: unknown message from the trainer" in stderr
    assert "tuple ('stop',)" in stderr


@pytest.mark.subprocess
def test_the_trainer_fails_on_an_answer_it_does_not_know() -> None:
    """An answer of the old form is an error where the trainer reads it (its reader
    then fails every save in flight), not a message it passes over."""
    arena = StagingArena()
    worker = TrainerSide(Hello(list(sys.path), logging.WARNING, None), [arena], 0)
    try:
        worker.wait_ready(60)
        with pytest.raises(CheckpointProcessError, match=r"unknown message from the checkpoint"):
            worker._settle(("saved", 0, None))
    finally:
        worker.stop()
        arena.close()
