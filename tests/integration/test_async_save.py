"""``dcp.async_save`` with S3StorageWriter: thread mode, DCP's stager, process mode, failures.

Thread-mode tests run in the test process without a process group (DCP then saves as a
single process). Process mode needs an initialized gloo group and ships the pickled
writer to DCP's background checkpoint process, so it runs in a spawned 1-rank job.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import _dist_worker as worker
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist_worker import server_options
from botocore.exceptions import ClientError
from s3_servers import ON_BOTH
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from s3ckpt import (
    BucketNotFoundError,
    HostStager,
    ReusingSavePlanner,
    S3StorageReader,
    S3StorageWriter,
)
from s3ckpt.format.manifest import MANIFEST_NAME
from s3ckpt.testing.local_s3 import LocalS3Server

pytestmark = [ON_BOTH]  # SeaweedFS and moto

MIB = 1 << 20
MISSING_BUCKET = "no-such-bucket-xyz"


def make_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "weight": torch.randn(128, 96, generator=g),
            "bias": torch.randn(96, generator=g).to(torch.bfloat16),
        },
        "ids": torch.arange(seed, seed + 300, dtype=torch.int64),
        "step": seed,
    }


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: snapshot(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v
        for k, v in state.items()
    }


def mutate(state: dict[str, Any]) -> None:
    """Change every tensor of ``state`` in place."""
    for value in state.values():
        if isinstance(value, dict):
            mutate(value)
        elif isinstance(value, torch.Tensor):
            value.add_(1)


def load(server: LocalS3Server, uri: str, like: dict[str, Any]) -> dict[str, Any]:
    target = _garbage(like)
    dcp.load(target, storage_reader=S3StorageReader(uri, **server_options(server)))
    return target


def _garbage(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: _garbage(v)
        if isinstance(v, dict)
        else torch.full_like(v, 7)
        if isinstance(v, torch.Tensor)
        else None
        for k, v in state.items()
    }


def assert_state_equal(actual: Any, expected: Any, path: str = "") -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), path
        for key in expected:
            assert_state_equal(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        assert torch.equal(actual, expected), f"{path} differs"
    else:
        assert actual == expected, path


def split(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix


def leftovers(server: LocalS3Server, uri: str) -> tuple[list[str], list[str]]:
    """(object keys, keys of pending multipart uploads) under the checkpoint prefix."""
    bucket, prefix = split(uri)
    client = server.client()
    objects = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])
    return [o["Key"] for o in objects], [u["Key"] for u in uploads]


def test_thread_mode_async_save_round_trip(local_s3: LocalS3Server, s3_prefix: str) -> None:
    state = make_state(1)
    future = dcp.async_save(
        state, storage_writer=S3StorageWriter(s3_prefix, **server_options(local_s3))
    )
    assert isinstance(future, Future)
    metadata = future.result(timeout=60)
    assert metadata.storage_meta.checkpoint_id == s3_prefix
    assert_state_equal(load(local_s3, s3_prefix, state), state)


def test_caller_is_blocked_only_for_staging(local_s3: LocalS3Server, s3_prefix: str) -> None:
    """async_save returns once the state is copied: later in-place changes are not saved."""
    state = make_state(2)
    original = snapshot(state)
    future = dcp.async_save(
        state, storage_writer=S3StorageWriter(s3_prefix, **server_options(local_s3))
    )
    mutate(state)  # right away, while the upload may still be running
    future.result(timeout=60)
    loaded = load(local_s3, s3_prefix, original)
    assert_state_equal(loaded, original)
    assert not torch.equal(loaded["model"]["weight"], state["model"]["weight"])


def test_default_stager_with_async_staging(local_s3: LocalS3Server, s3_prefix: str) -> None:
    state = make_state(3)
    original = snapshot(state)
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=False,
        )
    )
    try:
        response = dcp.async_save(
            state,
            storage_writer=S3StorageWriter(s3_prefix, **server_options(local_s3)),
            async_stager=stager,
        )
        assert isinstance(response, AsyncSaveResponse)
        assert response.staging_completion.result(timeout=60) is None
        mutate(state)  # staged: the upload must not see this
        response.upload_completion.result(timeout=60)
    finally:
        stager.close()
    assert_state_equal(load(local_s3, s3_prefix, original), original)


def test_process_mode_async_save(local_s3: LocalS3Server, s3_prefix: str, tmp_path: Path) -> None:
    """The writer is pickled into DCP's background process; failures come back through the future."""
    uris = {
        "first": f"{s3_prefix}/first",
        "second": f"{s3_prefix}/second",
        "missing_bucket": f"s3://{MISSING_BUCKET}/run/step-1",
    }
    worker.run_ranks(
        worker.process_mode_main, 1, server_options(local_s3), uris, str(tmp_path), timeout=200
    )
    report = torch.load(tmp_path / "rank0.pt", weights_only=True)

    # DCP's background process answered TERMINATE and was joined (exit code 0, not
    # killed) before the rank exited, so nothing is left running.
    assert report["background_exitcode"] == 0, report
    assert "background_killed" not in report

    failure = report["failure"]
    assert failure is not None, "the save to a missing bucket succeeded"
    assert failure["type"] == "torch.distributed.checkpoint.api.CheckpointException", failure
    assert failure["bucket_not_found"], failure
    assert MISSING_BUCKET in failure["message"], failure

    # The first save's in-place change after async_save returned did not reach S3, and
    # the background process kept serving after the failed save.
    assert_state_equal(
        load(local_s3, uris["first"], worker.process_mode_state(0)), worker.process_mode_state(0)
    )
    expected = worker.process_mode_state(0, offset=10)
    assert_state_equal(load(local_s3, uris["second"], expected), expected)


def test_failed_save_raises_through_the_future(local_s3: LocalS3Server) -> None:
    """A missing bucket fails the background save; the caller gets the s3ckpt error."""
    uri = f"s3://{MISSING_BUCKET}/run/step-1"
    future = dcp.async_save(
        make_state(4), storage_writer=S3StorageWriter(uri, **server_options(local_s3))
    )
    with pytest.raises(CheckpointException) as raised:
        future.result(timeout=60)
    found = [e for e in worker.find_exceptions(raised.value) if isinstance(e, BucketNotFoundError)]
    assert len(found) == 1, worker.find_exceptions(raised.value)
    # The save's first request: the coordinator's read of the manifest there.
    assert found[0].bucket == MISSING_BUCKET and found[0].operation == "GetObject", vars(found[0])
    # DCP reports per-rank failures: rank 0 (the only one) failed planning.
    assert set(raised.value.failures) == {0}
    # Nothing was created: not the bucket, so neither objects, uploads nor a manifest.
    with pytest.raises(ClientError) as missing:
        local_s3.client().head_bucket(Bucket=MISSING_BUCKET)
    assert missing.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404


class _FailingPlanner(DefaultSavePlanner):
    """Fails to produce the bytes of ``tail``, once earlier objects are really on the server.

    Before raising it waits until the server shows a completed data object and a pending
    multipart upload under the prefix, so the failure lands mid-save for certain.
    """

    def __init__(self, server: LocalS3Server, uri: str) -> None:
        super().__init__()
        self.server, self.uri = server, uri
        self.seen: tuple[list[str], list[str]] = ([], [])

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.index.fqn == "tail":
            deadline = time.monotonic() + 60  # a bound on a hang: the save gets there in ~1 s
            while time.monotonic() < deadline:
                self.seen = leftovers(self.server, self.uri)
                objects, uploads = self.seen
                if uploads and any("/data/" in key for key in objects):
                    raise RuntimeError("boom while resolving tail")
                time.sleep(0.05)
            raise AssertionError(f"no completed object and pending upload appeared: {self.seen}")
        return super().resolve_data(write_item)


def test_failed_upload_leaves_nothing_behind(local_s3: LocalS3Server, s3_prefix: str) -> None:
    """A save failing after one object is complete and during a multipart upload cleans up."""
    # At most 6 MiB per object: object 0 is "small" (one PUT); object 1 is "head" + "tail"
    # (a multipart upload of 5 MiB parts: the second part needs "tail", which fails).
    state = {
        "small": torch.arange(MIB // 4, dtype=torch.float32),  # 1 MiB
        "head": torch.arange(11 * MIB // 8, dtype=torch.float32),  # 5.5 MiB
        "tail": torch.ones(1024),
    }
    writer = S3StorageWriter(
        s3_prefix, part_size=5 * MIB, max_object_size=6 * MIB, **server_options(local_s3)
    )
    planner = _FailingPlanner(local_s3, s3_prefix)
    future = dcp.async_save(state, storage_writer=writer, planner=planner)
    with pytest.raises(CheckpointException) as raised:
        future.result(timeout=60)
    found = worker.find_exceptions(raised.value)
    assert any(isinstance(e, RuntimeError) and "boom" in str(e) for e in found), found
    objects, uploads = planner.seen  # at the moment of the failure
    objects = [o for o in objects if "/data/" in o]  # not the save's in-flight record
    assert len(objects) == 1 and objects[0].endswith("-0000.bin"), objects
    assert len(uploads) == 1 and uploads[0].endswith("-0001.bin"), uploads
    objects, uploads = leftovers(local_s3, s3_prefix)
    assert uploads == [], f"multipart uploads left behind: {uploads}"
    assert objects == [], f"objects left behind: {objects}"
    assert MANIFEST_NAME not in objects


def test_two_async_saves_in_flight(local_s3: LocalS3Server, s3_prefix: str) -> None:
    """Two saves to different checkpoint ids overlap; both commit and load."""
    first, second = make_state(5), make_state(6)
    uris = [f"{s3_prefix}/step-5", f"{s3_prefix}/step-6"]
    futures = [
        dcp.async_save(state, storage_writer=S3StorageWriter(uri, **server_options(local_s3)))
        for state, uri in zip([first, second], uris, strict=True)
    ]
    metadata = [f.result(timeout=60) for f in futures]
    assert [m.storage_meta.checkpoint_id for m in metadata] == uris
    assert metadata[0].storage_meta.save_id != metadata[1].storage_meta.save_id
    assert_state_equal(load(local_s3, uris[0], first), first)
    assert_state_equal(load(local_s3, uris[1], second), second)


def test_one_writer_reused_for_consecutive_checkpoint_ids(
    local_s3: LocalS3Server, s3_prefix: str
) -> None:
    """``checkpoint_id=`` re-points the same writer instance; each save gets its own save id."""
    writer = S3StorageWriter(**server_options(local_s3))  # no location: each save names one
    states = {f"{s3_prefix}/step-{i}": make_state(10 + i) for i in range(2)}
    save_ids = []
    for uri, state in states.items():
        metadata = dcp.async_save(state, checkpoint_id=uri, storage_writer=writer).result(
            timeout=60
        )
        assert metadata.storage_meta.checkpoint_id == uri
        save_ids.append(metadata.storage_meta.save_id)
    assert len(set(save_ids)) == 2
    for uri, state in states.items():
        assert_state_equal(load(local_s3, uri, state), state)


def test_previous_copy_is_freed_on_the_callers_thread(
    local_s3: LocalS3Server, s3_prefix: str
) -> None:
    """With one ``HostStager`` and one ``ReusingSavePlanner`` for every save (as README
    asks), a copy's tensors are freed when the next save stages, on the caller's thread:
    freeing a tensor lets the GIL go and takes it back, which the upload's thread must not
    do hundreds of times beside a training loop. The planner lets go of its view of the
    state once the items are written; otherwise the next save's planning frees them."""
    stager = _RecordingStager()
    planner = ReusingSavePlanner()
    freed_on: list[int] = []
    for step in range(3):
        uri = f"{s3_prefix}/step-{step}"
        dcp.async_save(
            make_state(step), storage_writer=S3StorageWriter(uri, **server_options(local_s3)),
            async_stager=stager, planner=planner, async_checkpointer_type=AsyncCheckpointerType.THREAD,
        ).result(timeout=60)  # fmt: skip
        if step == 0:
            for tensor in stager.tensors():
                weakref.finalize(tensor, lambda: freed_on.append(threading.get_ident()))
    assert not planner.state_dict  # let go, the plan kept
    # Those whose storage's copy DCP's copier still holds live on; the rest were freed.
    assert freed_on
    assert set(freed_on) == {threading.get_ident()}
    assert_state_equal(load(local_s3, f"{s3_prefix}/step-2", make_state(2)), make_state(2))


class _RecordingStager(HostStager):
    """A ``HostStager`` that keeps a note of its last copy."""

    def stage(self, state_dict: Any) -> Any:
        self.last = super().stage(state_dict)
        return self.last

    def tensors(self) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []
        pending = [self.last]
        while pending:
            value = pending.pop()
            if isinstance(value, dict):
                pending.extend(value.values())
            elif isinstance(value, torch.Tensor):
                found.append(value)
        return found


@pytest.fixture
def one_rank_mesh() -> Iterator[Any]:
    """A gloo group of one rank in this process, and a one-dimensional mesh over it."""
    import torch.distributed as dist
    from s3_servers import held_port
    from torch.distributed.device_mesh import init_device_mesh

    with held_port() as port:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_a_dtensor_over_a_view_inside_its_storage_is_staged_and_saved(
    local_s3: LocalS3Server, s3_prefix: str, one_rank_mesh: Any
) -> None:
    """A DTensor whose local tensor starts inside a larger storage (a shard cut from a
    bigger tensor or a flat buffer) is copied as its local tensor and saved as it is:
    DCP's own stager fails on it ("invalid python storage")."""
    from torch.distributed.tensor import DTensor, Replicate

    buffer = torch.arange(48.0)
    state = {
        "w": DTensor.from_local(buffer[8:32].view(6, 4), one_rank_mesh, [Replicate()]),
        "b": DTensor.from_local(buffer[40:], one_rank_mesh, [Replicate()]),
    }
    stager = HostStager()
    staged = stager.stage(state)
    assert type(staged["w"]) is DTensor and staged["w"].placements == (Replicate(),)
    assert torch.equal(staged["w"].to_local(), buffer[8:32].view(6, 4))
    buffer.add_(100)  # a copy: the source changing leaves it as it was
    assert torch.equal(staged["w"].to_local(), torch.arange(8.0, 32.0).view(6, 4))
    assert torch.equal(staged["b"].to_local(), torch.arange(40.0, 48.0))
    future = dcp.async_save(
        state, storage_writer=S3StorageWriter(s3_prefix, **server_options(local_s3)),
        async_stager=stager,
    )  # fmt: skip
    future.result(timeout=60)
    target = {k: DTensor.from_local(torch.zeros_like(v.to_local()), one_rank_mesh, [Replicate()])
              for k, v in state.items()}  # fmt: skip
    dcp.load(target, storage_reader=S3StorageReader(s3_prefix, **server_options(local_s3)))
    assert torch.equal(target["w"].to_local(), buffer[8:32].view(6, 4))
    assert torch.equal(target["b"].to_local(), buffer[40:])
    stager.close()
