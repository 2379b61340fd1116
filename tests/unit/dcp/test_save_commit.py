"""SaveCommit: the coordinator's commit, its order of requests, and what a failed one leaves."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from s3ckpt.config import S3URI
from s3ckpt.dcp import save_commit
from s3ckpt.dcp.compat import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
    WriteResult,
)
from s3ckpt.dcp.rank_save import RankRecord
from s3ckpt.dcp.save_commit import SaveCommit
from s3ckpt.errors import CheckpointError, CommitConflictError, StorageError
from s3ckpt.format.layout import HEARTBEAT_S, metadata_key
from s3ckpt.format.manifest import IndexRef, ObjectEntry
from s3ckpt.format.rank_index import ItemOwners

LOCATION = S3URI.parse("s3://bucket/run/step-1")
SAVE_ID = "coordinator0"


class Store:
    """The two requests the commit makes itself (the others are the transfer module's)."""

    def __init__(self, events: list[Any], refuse: str | None = None) -> None:
        self.events, self.refuse = events, refuse

    async def put(self, key: str, body: bytes, **kwargs: Any) -> None:
        if key == self.refuse:
            raise StorageError(f"refused {key}")
        self.events.append(("put", key))

    async def delete_many(self, keys: list[str]) -> None:
        self.events.append(("delete", sorted(keys)))


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What the commit did, in order; the transfer module's steps recorded, not sent."""
    seen: list[Any] = []

    async def mark(store: Any, location: S3URI, save_id: str) -> None:
        seen.append(("mark", save_id))

    async def clear(store: Any, location: S3URI, save_id: str) -> None:
        seen.append(("clear", save_id))

    async def confirm(store: Any, location: S3URI, sizes: dict[str, int]) -> None:
        seen.append(("confirm", sorted(sizes)))

    async def commit(store: Any, location: S3URI, manifest: Any, overwrite: bool) -> None:
        seen.append(("manifest", manifest.save_id, overwrite))

    monkeypatch.setattr(save_commit, "mark_in_flight", mark)
    monkeypatch.setattr(save_commit, "clear_in_flight", clear)
    monkeypatch.setattr(save_commit, "confirm_objects", confirm)
    monkeypatch.setattr(save_commit, "commit_manifest", commit)
    return seen


def _metadata() -> Metadata:
    """Two chunks of ``w``, one per rank."""
    chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([4])),
              ChunkStorageMetadata(torch.Size([4]), torch.Size([4]))]  # fmt: skip
    tensor = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([8]), chunks)
    return Metadata({"w": tensor})


def _results(replayed: str = "") -> list[list[WriteResult]]:
    """Rank 0 under the coordinator's save id, rank 1 under ``replayed`` (its own)."""
    results = []
    for rank, offset in ((0, 0), (1, 4)):
        save_id = replayed if rank == 1 and replayed else SAVE_ID
        record = RankRecord(
            rank,
            IndexRef(rank, f"index/r{rank}-{save_id}.idx", 10, 0, 1),
            (ObjectEntry(f"data/r{rank}-{save_id}.bin", 16, "etag", rank),),
            save_id,
        )
        index = MetadataIndex("w", torch.Size([offset]))
        results.append([WriteResult(index, 16, record)])
    return results


def test_a_commit_confirms_the_objects_then_writes_metadata_and_manifest(events):
    metadata = _metadata()
    commit = SaveCommit(Store(events), LOCATION, SAVE_ID, overwrite=True,
                        marked_at=time.monotonic())  # fmt: skip
    commit.run(metadata, _results(replayed="replay1"))
    keys = ["data/r0-coordinator0.bin", "data/r1-replay1.bin",
            "index/r0-coordinator0.idx", "index/r1-replay1.idx"]  # fmt: skip
    assert events == [
        ("confirm", keys),  # no "mark": the coordinator wrote the record just now
        ("put", LOCATION.key(metadata_key(SAVE_ID))),
        ("manifest", SAVE_ID, True),
        ("clear", "coordinator0"),  # every save id the ranks wrote under
        ("clear", "replay1"),
    ]
    owners = metadata.storage_data
    assert isinstance(owners, ItemOwners)
    assert (owners.rank_of("w", 0), owners.rank_of("w", 1)) == (0, 1)


@pytest.mark.parametrize("marked_at", [None, -HEARTBEAT_S])
def test_a_record_not_written_or_a_heartbeat_old_is_written_again_before_the_check(
    events, marked_at
):
    marked_at = None if marked_at is None else time.monotonic() + marked_at
    SaveCommit(Store(events), LOCATION, SAVE_ID, False, marked_at).run(_metadata(), _results())
    assert [e[0] for e in events] == ["mark", "confirm", "put", "manifest", "clear"]


def test_a_commit_that_fails_deletes_what_the_save_wrote(events, monkeypatch):
    async def lost(store: Any, location: S3URI, manifest: Any, overwrite: bool) -> None:
        raise CommitConflictError("another save committed first")

    async def other(store: Any, location: S3URI) -> str:
        return "another"

    monkeypatch.setattr(save_commit, "commit_manifest", lost)
    monkeypatch.setattr(save_commit, "committed_save_id", other)
    with pytest.raises(CommitConflictError):
        SaveCommit(Store(events), LOCATION, SAVE_ID, False).run(_metadata(), _results())
    deleted = next(e[1] for e in events if e[0] == "delete")
    assert LOCATION.key(metadata_key(SAVE_ID)) in deleted
    assert LOCATION.key("data/r1-coordinator0.bin") in deleted
    assert events[-1] == ("clear", SAVE_ID)  # the in-flight record last


@pytest.mark.parametrize("named", [SAVE_ID, None])
def test_a_commit_whose_manifest_names_it_or_cannot_be_read_deletes_nothing(
    events, monkeypatch, named
):
    """A commit whose response was lost is committed; an unreadable manifest leaves it to gc."""

    async def lost_response(store: Any, location: S3URI, manifest: Any, overwrite: bool) -> None:
        raise StorageError("connection reset")

    async def committed(store: Any, location: S3URI) -> str:
        if named is None:
            raise StorageError("unreadable")
        return named

    monkeypatch.setattr(save_commit, "commit_manifest", lost_response)
    monkeypatch.setattr(save_commit, "committed_save_id", committed)
    SaveCommit(Store(events), LOCATION, SAVE_ID, False).run(_metadata(), _results())
    assert not [e for e in events if e[0] == "delete"]
    assert events[-1] == ("clear", SAVE_ID)


def test_after_commit_objects_follow_the_commit_and_a_failed_one_raises(events):
    pointer = S3URI.parse("s3://bucket/run/latest")
    after = ((pointer, b"1"), (S3URI.parse("s3://bucket/run/refused"), b"2"))
    commit = SaveCommit(Store(events, refuse="run/refused"), LOCATION, SAVE_ID, False)
    with pytest.raises(CheckpointError, match="is committed, but"):
        commit.run(_metadata(), _results(), after)
    assert events.index(("put", "run/latest")) > events.index(("manifest", SAVE_ID, False))
