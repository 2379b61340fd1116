"""A multi-rank load's metadata read: the coordinator reads, the others receive."""

from __future__ import annotations

from typing import Any

import pytest

from s3ckpt import S3StorageReader
from s3ckpt.errors import CheckpointNotFoundError, S3CkptError
from s3ckpt.format.manifest import Manifest

URI = "s3://bucket/run/step-1"


class _Group:
    """A stand-in for DCP's collectives: records what is broadcast, hands out ``given``."""

    def __init__(self, is_coordinator: bool, given: Any = None) -> None:
        self.is_coordinator = is_coordinator
        self.given = given
        self.sent: list[Any] = []

    def broadcast_object(self, obj: Any) -> Any:
        self.sent.append(obj)
        return obj if self.is_coordinator else self.given


def _reader(monkeypatch: pytest.MonkeyPatch, fetched: Any) -> tuple[S3StorageReader, list[str]]:
    reader = S3StorageReader(URI, endpoint_url="http://127.0.0.1:9")
    calls: list[str] = []

    async def fetch(location: Any) -> Any:
        calls.append(str(location))
        if isinstance(fetched, BaseException):
            raise fetched
        return fetched

    monkeypatch.setattr(reader, "_fetch_metadata", fetch)
    return reader, calls


def test_other_ranks_make_no_request_and_take_the_coordinators_answer(monkeypatch):
    answer = (object(), b"metadata")
    reader, calls = _reader(monkeypatch, AssertionError("no request on this rank"))
    group = _Group(is_coordinator=False, given=answer)
    assert reader._shared_metadata(reader._require_location(), group) is answer
    assert calls == [] and group.sent == [None]


def test_the_coordinator_reads_once_and_broadcasts(monkeypatch):
    answer = (object(), b"metadata")
    reader, calls = _reader(monkeypatch, answer)
    group = _Group(is_coordinator=True)
    assert reader._shared_metadata(reader._require_location(), group) is answer
    assert calls == [URI] and group.sent == [answer]


def test_a_coordinator_failure_reaches_every_rank(monkeypatch):
    missing = CheckpointNotFoundError(f"no committed checkpoint at {URI} (no manifest)")
    reader, _ = _reader(monkeypatch, missing)
    group = _Group(is_coordinator=True)
    with pytest.raises(CheckpointNotFoundError):
        reader._shared_metadata(reader._require_location(), group)
    (sent,) = group.sent
    assert isinstance(sent, CheckpointNotFoundError)  # broadcast, not swallowed

    other, calls = _reader(monkeypatch, AssertionError("no request on this rank"))
    with pytest.raises(CheckpointNotFoundError, match="no manifest"):
        other._shared_metadata(other._require_location(), _Group(False, given=sent))
    assert calls == []


def test_an_error_that_cannot_travel_is_sent_as_its_message(monkeypatch):
    class Local(Exception):
        def __reduce__(self) -> Any:
            raise TypeError("cannot pickle")

    reader, _ = _reader(monkeypatch, Local("socket closed"))
    group = _Group(is_coordinator=True)
    with pytest.raises(Local):  # the coordinator raises its own error
        reader._shared_metadata(reader._require_location(), group)
    assert isinstance(group.sent[0], S3CkptError)  # the others get its message
    assert str(group.sent[0]) == "Local: socket closed"


def test_manifest_objects_survive_the_broadcast_pickle():
    import pickle

    from s3ckpt.format.manifest import IndexRef

    manifest = Manifest(
        "abc", 2, "metadata-abc.pkl", 1, 2, (), (), indexes=(IndexRef(0, "k", 1, 2, 3),)
    )
    assert pickle.loads(pickle.dumps(manifest)) == manifest


def test_without_a_process_group_a_reader_issues_no_collective(monkeypatch):
    """A reader given no group reads the metadata itself, even inside a multi-rank job:
    s3ckpt never guesses the group a load runs on."""
    import torch.distributed as dist

    from s3ckpt.dcp import process_group

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective was issued")

    monkeypatch.setattr(dist, "broadcast_object_list", refuse)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    assert process_group.shared_reads(None) is None
    answer = (Manifest("s", 1, "m", 1, 1, (), ()), b"x")
    reader, calls = _reader(monkeypatch, answer)
    monkeypatch.setattr(reader, "_adopt", lambda location, manifest, body: (manifest, body))
    assert reader.read_metadata() == answer and calls == [URI]


def test_a_group_of_one_rank_reads_alone(monkeypatch):
    import torch.distributed as dist

    from s3ckpt.dcp import process_group

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert process_group.shared_reads(object()) is None  # type: ignore[arg-type]
