"""CheckpointManager against the embedded S3 server: by-step names, resume, retention,
one save in flight with reused staging buffers, failures, metrics, and two gloo ranks."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import _manager_worker as worker
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _fresh_script import run_script

from s3ckpt import BucketNotFoundError, CheckpointManager, S3StorageWriter, SaveMetrics, catalog
from s3ckpt.config import S3URI
from s3ckpt.testing.local_s3 import LocalS3Server

MIB = 1 << 20


def manifest_etag(local_s3: LocalS3Server, uri: str) -> str:
    location = S3URI.parse(uri)
    head = local_s3.client().head_object(Bucket=location.bucket, Key=location.key("manifest.json"))
    return head["ETag"]


def assert_restored(loaded: dict[str, Any], expected: dict[str, Any]) -> None:
    """Parameters, AdamW moments and the plain tensor all came back bit for bit."""
    assert set(loaded["params"]) == set(expected["params"])
    for key, value in expected["params"].items():
        assert torch.equal(loaded["params"][key], value), key
    assert len(loaded["exp_avg"]) == len(expected["exp_avg"]) > 0
    for got, want in zip(loaded["exp_avg"], expected["exp_avg"], strict=True):
        assert torch.equal(got, want)
    assert torch.equal(loaded["own"], expected["own"])


def test_save_resume_with_stateful_model_and_optimizer(s3_prefix, s3_options, list_keys):
    model, state = worker.make_state(0, seed=1)
    with CheckpointManager(s3_prefix, **s3_options) as manager:
        assert manager.load_latest(state) is None  # nothing committed yet
        for step in (1, 2, 3):
            worker.train_step(model, state, step)
            assert manager.save(step, state) is True
        manager.wait()
        assert manager.steps() == [1, 2, 3]
        assert manager.latest_step() == 3
        expected = worker.snapshot(model, state, 0)
    assert "step-0000000003/manifest.json" in list_keys(s3_prefix)

    fresh_model, fresh = worker.make_state(0, seed=2)
    with CheckpointManager(s3_prefix, **s3_options) as restarted:
        assert restarted.load_latest(fresh) == 3
    assert_restored(worker.snapshot(fresh_model, fresh, 0), expected)


def test_staging_buffers_are_reused_without_mixing_saves(s3_prefix, s3_options):
    """Each save holds the values of its call, although the next one reuses its buffers."""
    weights = torch.zeros(8 * MIB // 4)
    state = {"w": weights}
    with CheckpointManager(s3_prefix, **s3_options) as manager:
        for step in (1, 2, 3):
            weights.fill_(step)
            manager.save(step, state)
            weights.fill_(-1)  # right after staging: must reach no checkpoint
        metrics = manager.wait()
        assert metrics is not None and metrics.step == 3
        for step in (1, 2, 3):
            target = {"w": torch.empty_like(weights)}
            manager.load(step, target)
            assert torch.all(target["w"] == step), step
        assert [m.step for m in manager.metrics] == [1, 2, 3]


@pytest.mark.parametrize("mode", ["process", "thread", "sync"])
def test_retention_keeps_last_and_every_and_foreign_checkpoints(
    s3_prefix, s3_options, local_s3, mode
):
    """Applied where each mode's save runs (the checkpoint process, the save thread, the
    manager), and done once ``wait`` returns."""
    # A checkpoint the manager did not name is never its to delete.
    dcp.save(
        {"x": torch.ones(3)}, storage_writer=S3StorageWriter(f"{s3_prefix}/best", **s3_options)
    )
    state = {"x": torch.zeros(3)}
    options = {"keep_last": 2, "keep_every": 3, "async_mode": mode, **s3_options}
    with CheckpointManager(s3_prefix, **options) as manager:
        for step in range(1, 8):
            manager.save(step, state)
        manager.wait()
        assert manager.steps() == [3, 6, 7]
    names = [
        i["Key"]
        for i in local_s3.client()
        .list_objects_v2(Bucket=local_s3.bucket, Prefix=S3URI.parse(s3_prefix).prefix + "/best/")
        .get("Contents", [])
    ]
    assert any(n.endswith("manifest.json") for n in names)


def test_rollback_save_is_not_pruned(s3_prefix, s3_options):
    state = {"x": torch.zeros(3)}
    with CheckpointManager(s3_prefix, **s3_options) as manager:
        for step in (10, 20, 30):
            manager.save(step, state)
    with CheckpointManager(s3_prefix, keep_last=1, **s3_options) as manager:
        manager.load(10, state)
        manager.save(15, state)  # the rolled-back run's first save
        manager.wait()
        steps = manager.steps()
    # 30 is superseded (and so pruned) once 15 commits in a later second than it did
    # (S3 times have whole seconds); 15 is kept either way
    assert steps in ([15], [15, 30])


def test_existing_step_is_skipped_or_overwritten(s3_prefix, s3_options, local_s3):
    state = {"x": torch.arange(4.0)}
    with CheckpointManager(s3_prefix, **s3_options) as manager:
        manager.save(5, state)
    etag = manifest_etag(local_s3, f"{s3_prefix}/step-0000000005")
    with CheckpointManager(s3_prefix, **s3_options) as resumed:
        assert resumed.load_latest(state) == 5
        assert resumed.save(5, state) is False  # the loop re-ran step 5: keep the original
    assert manifest_etag(local_s3, f"{s3_prefix}/step-0000000005") == etag
    state["x"] += 1
    with CheckpointManager(s3_prefix, overwrite=True, **s3_options) as replacing:
        replacing.steps()
        assert replacing.save(5, state) is True
    assert manifest_etag(local_s3, f"{s3_prefix}/step-0000000005") != etag
    with CheckpointManager(s3_prefix, **s3_options) as reader:
        target = {"x": torch.zeros(4)}
        reader.load(5, target)
    assert torch.equal(target["x"], torch.arange(4.0) + 1)


def test_background_failure_is_logged_and_raised_once(local_s3, s3_options, caplog):
    manager = CheckpointManager("s3://no-such-bucket-mgr/run", **s3_options)
    with caplog.at_level(logging.ERROR, logger="s3ckpt.manager"):
        assert manager.save(1, {"x": torch.ones(2)}) is True  # staged; fails in the background
        with pytest.raises(BucketNotFoundError) as raised:
            manager.wait()
    assert raised.value.bucket == "no-such-bucket-mgr"
    assert "background save of step-0000000001 failed" in caplog.text
    manager.wait()  # raised once, not again
    manager.close()


def test_metrics_callback_and_sync_mode(s3_prefix, s3_options):
    seen: list[SaveMetrics] = []
    state = {"x": torch.zeros(MIB)}  # 4 MiB
    with CheckpointManager(s3_prefix, async_mode="sync", on_saved=seen.append, **s3_options) as m:
        assert m.save(1, state) is True
        assert not m.busy  # sync: committed on return
        assert m.steps() == [1]
    (metrics,) = seen
    assert metrics.bytes == 4 * MIB
    assert metrics.upload_s > 0 and metrics.throughput_mb_s > 0
    assert metrics.blocked_s >= metrics.upload_s
    assert set(metrics.as_dict()) >= {"step", "blocked_s", "upload_s", "bytes", "throughput_mb_s"}


def test_checkpoints_named_by_others_are_its_steps(s3_prefix, s3_options):
    """``step-100`` saved by hand under the manager's prefix is step 100: listed, loaded
    from ``step-100``, and pruned like the manager's own (``s3ckpt.step_of``)."""
    other = f"{s3_prefix}/step-100"
    dcp.save({"w": torch.ones(8)}, storage_writer=S3StorageWriter(other, **s3_options))
    state = {"w": torch.zeros(8)}
    with CheckpointManager(s3_prefix, keep_last=0, async_mode="sync", **s3_options) as manager:
        assert manager.steps() == [100] and manager.uri_of(100) == other
        assert manager.load_latest(state) == 100 and torch.equal(state["w"], torch.ones(8))
        manager.save(200, state)
        manager.save(300, state)
    # close() waited for retention (keep_last=0): only the newest stayed
    names = [i.name for i in catalog.list_checkpoints(s3_prefix, **s3_options)]
    assert names == ["step-0000000300"]


def test_skip_policy_skips_while_uploading(s3_prefix, s3_options, monkeypatch):
    """The first save's commit is held until the second has been skipped, so that "still
    uploading" does not depend on how fast the upload is (thread mode: the hold is made
    in this process)."""
    uploading = threading.Event()
    commit = S3StorageWriter.finish

    def held_commit(writer: S3StorageWriter, *args: Any, **kwargs: Any) -> Any:
        assert uploading.wait(timeout=300), "the test never let the commit go"
        return commit(writer, *args, **kwargs)

    monkeypatch.setattr(S3StorageWriter, "finish", held_commit)
    state = {"x": torch.randn(1024)}
    with CheckpointManager(s3_prefix, if_busy="skip", async_mode="thread", **s3_options) as m:
        assert m.save(1, state) is True
        assert m.busy
        assert m.save(2, state) is False
        uploading.set()
        m.wait()
        assert not m.busy
        assert m.save(3, state) is True
    with CheckpointManager(s3_prefix, **s3_options) as reader:
        assert reader.steps() == [1, 3]


@pytest.mark.distributed
def test_two_ranks(local_s3, s3_prefix, s3_options: dict[str, Any], tmp_path):
    worker.run_ranks(worker.manager_main, 2, s3_options, s3_prefix, str(tmp_path), timeout=240)
    reports = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for report in reports:
        assert report["initial"] is None
        assert [report[f"saved{s}"] for s in (1, 2, 3)] == [True, True, True]
        assert report["steps"] == [2, 3], report["steps"]  # keep_last=2, pruned on rank 0
        assert report["latest"] == 3 and report["restored"] == 3
        assert report["resave"] is False
        assert report["last_metrics"].step == 3 and report["last_metrics"].bytes > 0
        assert_restored(report["loaded"], report["expected"])
        assert report["process_mode"]["steps"] == [7]
        assert report["process_mode"]["bytes"] > 0
        assert report["process_mode"]["background_stopped"]
    assert reports[0]["skips"] == reports[1]["skips"]  # one decision for all ranks
    assert reports[0]["skips"][0] is True


def test_one_rank_groups_and_a_rank_that_cannot_stage(local_s3, s3_prefix, s3_options, tmp_path):
    """Two gloo ranks: a manager on a group of rank 0 alone saves without waiting for
    rank 1; a copy that fails on rank 1 makes every rank raise at its next save, after
    which both save again in step (thread and process modes)."""
    worker.run_ranks(worker.group_edges_main, 2, s3_options, s3_prefix, str(tmp_path), timeout=180)
    reports = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert reports[0]["solo"] == [1, 2]
    for mode in ("thread", "process"):
        staging = [r[mode] for r in reports]
        assert staging[0]["first"] is True, mode
        assert staging[1]["first"] == (
            "raised: saving step-0000000001 failed: RuntimeError: cannot pin memory"
        ), mode
        for outcome in staging:
            assert outcome["second"] == (
                "raised: step-0000000001 not saved: rank 1 could not copy its state to host "
                "memory (RuntimeError: cannot pin memory)"
            ), mode
            assert outcome["third"] is True, mode
            assert outcome["steps"] == [3], mode
            assert outcome["uncommitted"] == [], mode  # the failed save wrote nothing


OPTIONS_SCRIPT = """\
import json, sys, torch
from fractions import Fraction  # outside torch's weights-only allowlist
from s3ckpt import CheckpointManager, StateMismatchError, UntrustedPickleError

# the documented form: options given at construction, changed between saves as attributes
manager = CheckpointManager(sys.argv[1], endpoint_url=sys.argv[2])
seen = {"options": [manager.if_busy, manager.strict, manager.writer_options,
                    manager.reader_options]}
manager.save(1, {"w": torch.zeros(1 << 20)})
manager.wait()
manager.writer_options = {"compression": "zstd"}
manager.save(2, {"w": torch.zeros(1 << 20), "position": Fraction(3)})
manager.wait()
manager.if_busy = "skip"
manager.writer_options = {}
manager.save(3, {"r": torch.randn(8 << 20)})  # 32 MiB still uploading at the next call
seen["busy"] = manager.busy
seen["skipped"] = manager.save(4, {"r": torch.randn(1)}) is False
manager.wait()
state = {"w": torch.ones(1 << 20), "position": Fraction(0)}
try:
    manager.load(2, state)
except UntrustedPickleError:
    seen["untrusted"] = True
manager.reader_options = {"trust_pickles": True}
manager.load(2, state)
seen["loaded"] = [str(state["position"]), state["w"].sum().item()]
manager.strict = True
try:
    manager.load(2, {"w": torch.ones(1 << 20)})  # "position" has no place
except StateMismatchError as exc:
    seen["mismatch"] = list(exc.dropped)
manager.strict = False
manager.load(2, {"w": torch.ones(1 << 20)})
manager.close()
print(json.dumps(seen))
"""


@pytest.mark.subprocess
def test_options_changed_between_saves_apply_in_a_fresh_process(
    s3_prefix, s3_options, local_s3, tmp_path
):
    """A user's script (process mode, the default) changes ``writer_options``, ``if_busy``,
    ``reader_options`` and ``strict`` on its manager between saves and loads: each save
    and load after the change follows it."""
    done = run_script(tmp_path, OPTIONS_SCRIPT, s3_options, s3_prefix, local_s3.endpoint_url)
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["options"] == ["wait", False, {}, {}]
    sizes = {i.name: i.bytes for i in catalog.list_checkpoints(s3_prefix, **s3_options)}
    assert set(sizes) == {"step-0000000001", "step-0000000002", "step-0000000003"}
    assert sizes["step-0000000001"] > 4 << 20  # 4 MiB of zeros, stored raw
    assert sizes["step-0000000002"] < 1 << 20  # the same zeros, zstd-compressed
    assert sizes["step-0000000003"] > 32 << 20  # compression turned off again
    assert seen["busy"] and seen["skipped"]
    assert seen["untrusted"] is True
    assert seen["loaded"] == ["3", 0.0]
    assert seen["mismatch"] == ["position"]
