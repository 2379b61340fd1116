"""torch-checkpointing's ``CheckpointManager`` saving to and loading from S3 through
``s3ckpt.integrations.torch_checkpointing``: committed by a manifest written last, seen by
the catalog like any s3ckpt checkpoint, every read checked."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3_servers import ON_BOTH
from torch_checkpointing import CheckpointManager

from s3ckpt import S3StorageReader, catalog
from s3ckpt.config import make_config
from s3ckpt.errors import CheckpointExistsError, ConfigError, CorruptCheckpointError
from s3ckpt.format.manifest import MANIFEST_NAME
from s3ckpt.integrations.torch_checkpointing import (
    S3StorageConfig,
    manager_config,
)

pytestmark = [ON_BOTH]
MiB = 1024 * 1024


def _state(seed: int, mib: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(mib * MiB // 4, generator=g), "b": torch.arange(7) * seed},
        "step": seed,
    }


def _empty(mib: int = 1) -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(mib * MiB // 4), "b": torch.zeros(7, dtype=torch.long)},
        "step": 0,
    }


def _wait(future: Any) -> None:
    if future is not None:  # an asynchronous save
        future.result(timeout=300)


def _manager(uri: str, s3: dict[str, Any], **options: Any) -> CheckpointManager:
    return CheckpointManager(manager_config(uri, **s3, **options))


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_a_save_commits_by_manifest_and_loads_back_bit_exact(
    s3_prefix, s3_options, list_keys, sync
):
    manager = _manager(s3_prefix, s3_options, sync=sync)
    try:
        state = _state(3, mib=20)  # several parts and checksum blocks
        future = manager.save(f"{s3_prefix}/step-3", state)
        if future is not None:
            future.result(timeout=300)
        keys = list_keys(f"{s3_prefix}/step-3")
        assert MANIFEST_NAME in keys
        assert not any(k.endswith(".pt") for k in keys), keys  # names live in the index
        loaded = manager.load(f"{s3_prefix}/step-3", into=_empty(mib=20))
    finally:
        manager.close()
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert torch.equal(loaded["model"]["b"], state["model"]["b"])
    assert loaded["step"] == 3


def test_the_catalog_sees_verifies_and_prunes_them(s3_prefix, s3_options):
    manager = _manager(s3_prefix, s3_options, sync=True)
    try:
        for step in (1, 2, 3):
            manager.save(f"{s3_prefix}/step-{step}", _state(step))
    finally:
        manager.close()
    listed = catalog.list_checkpoints(s3_prefix, **s3_options)
    assert [(i.name, i.committed) for i in listed] == [
        ("step-1", True), ("step-2", True), ("step-3", True)
    ]  # fmt: skip
    report = catalog.verify_checkpoint(f"{s3_prefix}/step-2", **s3_options)
    assert report.ok and report.items == 2, report
    catalog.prune(s3_prefix, keep_last=1, **s3_options)
    assert [i.name for i in catalog.list_checkpoints(s3_prefix, **s3_options)] == ["step-3"]


def test_dcp_loads_each_torch_file_as_the_object_it_holds(s3_prefix, s3_options):
    manager = _manager(s3_prefix, s3_options, sync=True)
    try:
        manager.save(f"{s3_prefix}/step-5", _state(5))
    finally:
        manager.close()
    reader = S3StorageReader(f"{s3_prefix}/step-5", **s3_options)
    names = sorted(reader.read_metadata().state_dict_metadata)
    assert len(names) == 2 and any(n.startswith("model") for n in names), names
    files: dict[str, Any] = {name: io.BytesIO() for name in names}
    dcp.load(
        files, storage_reader=S3StorageReader(f"{s3_prefix}/step-5", **s3_options), no_dist=True
    )
    model = files[next(n for n in names if n.startswith("model"))]
    assert torch.equal(model["w"], _state(5)["model"]["w"])


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_a_committed_checkpoint_is_never_written_over(s3_prefix, s3_options, list_keys, sync):
    manager = _manager(s3_prefix, s3_options, sync=sync)
    try:
        _wait(manager.save(f"{s3_prefix}/step-1", _state(1)))
        before = list_keys(f"{s3_prefix}/step-1")
        with pytest.raises(CheckpointExistsError, match="already committed"):
            _wait(manager.save(f"{s3_prefix}/step-1", _state(2)))  # also from its process
        assert list_keys(f"{s3_prefix}/step-1") == before
        loaded = manager.load(f"{s3_prefix}/step-1", into=_empty())
    finally:
        try:
            manager.close()
        except Exception as exc:  # torch-checkpointing's close raises a failed save's error again
            if sync or "already committed" not in str(exc):
                raise
    assert torch.equal(loaded["model"]["w"], _state(1)["model"]["w"])


def test_a_save_that_dies_before_its_commit_is_invisible(s3_prefix, s3_options, monkeypatch):
    from s3ckpt.integrations.torch_checkpointing import commit

    async def dies(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("killed before the manifest")

    monkeypatch.setattr(commit, "commit_manifest", dies)
    manager = _manager(s3_prefix, s3_options, sync=True)
    try:
        with pytest.raises(RuntimeError, match="killed before the manifest"):
            manager.save(f"{s3_prefix}/step-1", _state(1))
        storage = S3StorageConfig(s3_prefix, make_config(None, **s3_options)).create_storage()
        assert not storage.exists(Path(f"{s3_prefix}/step-1"))
        listed = catalog.list_checkpoints(s3_prefix, include_uncommitted=True, **s3_options)
        assert [(i.name, i.committed) for i in listed] == [("step-1", False)]
        monkeypatch.undo()
        manager.save(f"{s3_prefix}/step-1", _state(4))  # the same name, saved again
        loaded = manager.load(f"{s3_prefix}/step-1", into=_empty())
    finally:
        manager.close()
    assert torch.equal(loaded["model"]["w"], _state(4)["model"]["w"])
    collected = catalog.collect_garbage(s3_prefix, grace=0, lease=0, **s3_options)
    assert collected.objects > 0  # the objects of the save that died


def test_a_flipped_bit_is_read_again_then_reported(s3_prefix, s3_options, local_s3):
    manager = _manager(s3_prefix, s3_options, sync=True)
    try:
        manager.save(f"{s3_prefix}/step-1", _state(1))
        storage = manager_config(s3_prefix, **s3_options).storage_config.create_storage()
        name = next(n for n in storage.ls(Path(f"{s3_prefix}/step-1")) if n.startswith("model"))
        stored = storage._checkpoint("step-1").stored(storage.store, name)
        key = f"{s3_prefix.split('/', 3)[3]}/step-1/{stored.key}"
        client = local_s3.client()
        body = bytearray(client.get_object(Bucket=local_s3.bucket, Key=key)["Body"].read())
        body[12345] ^= 0x10
        client.put_object(Bucket=local_s3.bucket, Key=key, Body=bytes(body))
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            storage.read(Path(f"{s3_prefix}/step-1/{name}"))
    finally:
        manager.close()


def test_paths_outside_the_run_and_renamed_checkpoints_are_refused(s3_prefix, s3_options):
    storage = manager_config(s3_prefix, **s3_options).storage_config.create_storage()
    with pytest.raises(ConfigError, match="not under this storage's run"):
        storage.exists(Path("s3://elsewhere/run/step-1"))
    with pytest.raises(ConfigError, match="write_to_temp_dir=False"):
        storage.rename(
            Path(f"{s3_prefix}/tmp_step-1"), Path(f"{s3_prefix}/step-1"), is_directory=True
        )
    assert (
        storage.remap_path(Path(f"{s3_prefix}/step-1/model_0.pt"))
        == f"{s3_prefix}/step-1/model_0.pt"
    )


@pytest.mark.distributed
def test_two_ranks_save_their_files_and_rank_0_commits(local_s3, s3_prefix, tmp_path):
    import _torch_checkpointing_worker as rank_side
    from _dist_worker import run_ranks, server_options

    run_ranks(
        rank_side.two_ranks_main, 2, server_options(local_s3), s3_prefix, str(tmp_path), timeout=300
    )
    for rank in range(2):
        report = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert torch.equal(report["loaded"]["model"]["w"], rank_side.rank_state(rank)["model"]["w"])
        assert report["loaded"]["step"] == 7
        assert report["listed"] == ("step-7", True, 2, 4)  # two files per rank


def test_reads_anywhere_in_a_file_are_checked_and_exact(s3_prefix, s3_options):
    manager = _manager(s3_prefix, s3_options, sync=True)
    try:
        manager.save(f"{s3_prefix}/step-1", _state(1, mib=20))
    finally:
        manager.close()
    storage = manager_config(s3_prefix, **s3_options).storage_config.create_storage()
    name = next(n for n in storage.ls(Path(f"{s3_prefix}/step-1")) if n.startswith("model"))
    path = Path(f"{s3_prefix}/step-1/{name}")
    whole = storage.read(path)
    assert len(whole) == storage.getsize(path) > 20 * MiB
    with storage.stream_read(path) as stream:
        pieces = []
        for start, size in [(100, 1000), (9 * MiB - 5, 10), (0, 3), (len(whole) - 7, 100)]:
            assert stream.seek(start) == start
            pieces.append((start, stream.read(size)))
        assert stream.read(5) == b""  # at the end
    for start, got in pieces:
        assert got == whole[start : start + len(got)] and got


def test_faults_on_the_way_are_retried_and_reads_stay_exact(local_s3, s3_prefix, s3_options):
    from faultproxy import FaultProxy, Rule

    rules = (  # each data object's first PUT cut, its first GETs damaged, then 503s anywhere
        Rule("reset_request", methods=("PUT",), match="/data/", after=64 * 1024, limit=1),
        Rule("corrupt", methods=("GET",), match="/data/", after=1000, limit=1),
        Rule("reset_response", methods=("GET",), match="/data/", after=4096, limit=1),
        Rule("slowdown", rate=0.2),
    )
    with FaultProxy(local_s3.endpoint_url, seed=11) as proxy:
        proxy.add(*rules)
        through = {**s3_options, "endpoint_url": proxy.endpoint_url, "read_timeout": 5.0}
        manager = _manager(s3_prefix, through, sync=True)
        try:
            state = _state(9, mib=12)
            manager.save(f"{s3_prefix}/step-9", state)
            loaded = manager.load(f"{s3_prefix}/step-9", into=_empty(mib=12))
        finally:
            manager.close()
        fired = dict(proxy.counts)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["step"] == 9
    assert {k: fired.get(k) for k in ("reset_request", "corrupt", "reset_response")} == {
        "reset_request": 1, "corrupt": 1, "reset_response": 1
    }, fired  # fmt: skip
