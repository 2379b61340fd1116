"""Saves whose planner caches or replays plans still get an identity of their own.

DCP's ``DefaultSavePlanner(enable_plan_caching=True)`` hands ``write_data`` the final plan
cached at the first save, that save's ``storage_data`` included; Megatron-core's constant
structure mode reuses a central plan without planning at all. Each save must still write
under keys of its own, so an overwrite never touches the checkpoint it replaces before
its manifest exists.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import _dist_worker as worker
import _plan_cache_worker as cache_worker
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from s3ckpt import ConfigError, S3StorageWriter
from s3ckpt.dcp.save_identity import RankAssignment, claim, successor
from s3ckpt.format.manifest import MANIFEST_NAME
from s3ckpt.testing.local_s3 import LocalS3Server


def _manifest(server: LocalS3Server, uri: str) -> dict[str, Any]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    body = server.client().get_object(Bucket=bucket, Key=f"{prefix}/{MANIFEST_NAME}")["Body"]
    return json.loads(body.read())


def _keys(manifest: dict[str, Any]) -> set[str]:
    return {
        *(o["key"] for o in manifest["objects"]),
        *(i["key"] for i in manifest["indexes"]),
        manifest["metadata_key"],
    }


@pytest.mark.distributed
def test_two_ranks_with_plan_caching_save_each_checkpoint_under_its_own_keys(
    seaweedfs_s3: LocalS3Server, tmp_path
):
    base = f"s3://{seaweedfs_s3.bucket}/plan-caching-{secrets.token_hex(4)}"
    s3 = worker.server_options(seaweedfs_s3)
    worker.run_ranks(cache_worker.plan_caching_main, 2, s3, base, str(tmp_path), timeout=240)
    reports = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]

    for rank, report in enumerate(reports):
        for version, loaded in report["loaded_new"].items():
            for key, shard in loaded.items():
                assert torch.equal(shard, torch.full_like(shard, float(version))), (
                    f"rank {rank}, save {version}, {key}"
                )
        for key, shard in report["loaded_over"].items():
            assert torch.equal(shard, torch.full_like(shard, 12.0)), f"rank {rank}, {key}"
    # Just before each overwrite committed, the checkpoint it replaces still loaded whole.
    assert reports[0]["seen_before_commit"] == [None, 10.0, 11.0]

    manifests = [_manifest(seaweedfs_s3, f"{base}/new-{v}") for v in (1, 2, 3)]
    save_ids = [m["save_id"] for m in manifests]
    assert len(set(save_ids)) == 3, save_ids
    for manifest in manifests:
        assert all(manifest["save_id"] in key for key in _keys(manifest)), manifest


def _save_planned(writer: S3StorageWriter, state: dict[str, Any]) -> Any:
    """One save with a planner that keeps its final plan, as a reusing caller would."""

    class KeepingPlanner(DefaultSavePlanner):
        def finish_plan(self, new_plan: Any) -> Any:
            self.final = super().finish_plan(new_plan)
            return self.final

    planner = KeepingPlanner()
    dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
    return planner


def _replay(writer: S3StorageWriter, state: dict[str, Any], cached: Any) -> None:
    """A save that reuses ``cached``, the final plan of an earlier save, without planning
    (Megatron-core's ``--ckpt-assume-constant-structure``)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    metadata = planner.create_global_plan([planner.create_local_plan()])[1]
    writer.set_up_storage_writer(True)
    writer.prepare_local_plan(cached)
    results = writer.write_data(cached, planner).wait()
    writer.finish(metadata, [results])


def test_a_replayed_plan_overwrites_without_touching_the_replaced_checkpoint(
    s3_prefix, make_writer, make_reader, list_keys, local_s3
):
    first = {"w": torch.full((300, 7), 1.0), "b": torch.arange(5)}
    planner = _save_planned(make_writer(s3_prefix), first)
    replaced = _keys(_manifest(local_s3, s3_prefix))

    second = {"w": torch.full((300, 7), 2.0), "b": torch.arange(5) * 2}
    _replay(make_writer(s3_prefix, overwrite=True), second, planner.final)
    third = {"w": torch.full((300, 7), 3.0), "b": torch.arange(5) * 3}
    _replay(make_writer(s3_prefix, overwrite=True), third, planner.final)

    committed = _manifest(local_s3, s3_prefix)
    assert not _keys(committed) & replaced
    assert replaced <= set(list_keys(s3_prefix)), "the replaced save's objects were touched"
    loaded = {"w": torch.zeros(300, 7), "b": torch.zeros(5, dtype=torch.int64)}
    dcp.load(loaded, storage_reader=make_reader(s3_prefix))
    assert torch.equal(loaded["w"], third["w"]) and torch.equal(loaded["b"], third["b"])
    assert not [k for k in list_keys(s3_prefix) if ".s3ckpt-saving-" in k], "in-flight records left"


def test_a_replayed_assignment_gets_a_successor_every_rank_agrees_on():
    save_id = secrets.token_hex(8)
    first = claim(RankAssignment(0, save_id), rank=0)
    assert first == RankAssignment(0, save_id)
    replays = [claim(RankAssignment(0, save_id), rank=0) for _ in range(3)]
    assert [r.save_id for r in replays] == [successor(save_id, n) for n in (1, 2, 3)]
    assert len({save_id, *(r.save_id for r in replays)}) == 4
    # Rank 1 replaying its copy of the same cached plan derives the same ids.
    assert claim(RankAssignment(1, save_id), rank=1).save_id == save_id
    assert claim(RankAssignment(1, save_id), rank=1).save_id == replays[0].save_id


def test_a_plan_without_an_assignment_or_of_another_rank_is_refused():
    with pytest.raises(ConfigError, match="no S3StorageWriter rank assignment"):
        claim(None, rank=0)
    with pytest.raises(ConfigError, match="plan of rank 1"):
        claim(RankAssignment(1, secrets.token_hex(8)), rank=0)
