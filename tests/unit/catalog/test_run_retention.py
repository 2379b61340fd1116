"""Retention after a commit to a run, as the engine that committed applies it."""

from __future__ import annotations

import logging
import pickle
from typing import Any

import pytest

from s3ckpt import S3Config
from s3ckpt.catalog import run_retention
from s3ckpt.catalog.listing import CheckpointInfo
from s3ckpt.catalog.run_retention import RunRetention
from s3ckpt.config import S3URI

RUN = S3URI("bucket", "run")
CONFIG = S3Config(endpoint_url="http://127.0.0.1:9")


def info(name: str, t: float) -> CheckpointInfo:
    return CheckpointInfo(name, f"s3://bucket/run/{name}", True, t, 1, 1, 1)


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """The run's listing, and what retention removed from it."""
    seen: dict[str, list[Any]] = {"listing": [], "removed": [], "listed": []}

    def listing(uri: str, **kwargs: Any) -> list[CheckpointInfo]:
        seen["listed"].append(uri)
        return list(seen["listing"])

    monkeypatch.setattr(run_retention, "list_checkpoints", listing)
    monkeypatch.setattr(
        run_retention, "remove_checkpoint", lambda uri, **k: seen["removed"].append(uri)
    )
    return seen


def test_the_policy_deletes_what_it_expires_never_the_checkpoint_just_committed(store):
    retention = RunRetention(RUN, CONFIG, keep_last=1, keep_every=None)
    # a rollback: step 2 is committed after step 3, so it is not the highest step
    store["listing"] = [info("step-0000000001", 10), info("step-0000000003", 20),
                        info("step-0000000002", 30), info("best", 5)]  # fmt: skip
    retention.after_commit(RUN.child("step-0000000002"))
    assert sorted(store["removed"]) == [
        "s3://bucket/run/step-0000000001",
        "s3://bucket/run/step-0000000003",  # superseded by the rollback's commit
    ]
    assert retention.since == 30  # the store's time of the first commit seen


def test_a_checkpoint_not_directly_under_the_run_changes_nothing(store):
    retention = RunRetention(RUN, CONFIG, keep_last=1, keep_every=None)
    retention.after_commit(S3URI("bucket", "other/step-0000000002"))
    retention.after_commit(S3URI("bucket", "run/nested/step-0000000002"))
    assert store["listed"] == [] and store["removed"] == []


def test_without_a_policy_nothing_is_listed(store):
    retention = RunRetention(RUN, CONFIG, keep_last=None, keep_every=None)
    assert not retention.enabled
    retention.after_commit(RUN.child("step-0000000002"))
    assert store["listed"] == []


def test_a_failed_listing_is_logged_not_raised(monkeypatch, caplog):
    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("unreachable")

    monkeypatch.setattr(run_retention, "list_checkpoints", broken)
    retention = RunRetention(RUN, CONFIG, keep_last=1, keep_every=None)
    with caplog.at_level(logging.WARNING, logger="s3ckpt.manager"):
        retention.after_commit(RUN.child("step-0000000004"))
    assert "retention after step-0000000004: could not list s3://bucket/run" in caplog.text


def test_it_travels_to_the_checkpoint_process_with_what_it_learned():
    retention = RunRetention(RUN, CONFIG, keep_last=2, keep_every=5, since=12.5)
    assert pickle.loads(pickle.dumps(retention)) == retention
