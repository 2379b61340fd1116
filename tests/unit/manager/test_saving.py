"""Saving: the manager's save path, here in sync mode (``dcp.save`` in the caller): which
steps are saved, with which writer, and what a save leaves in the ledger. The background
policy (one in flight, wait or skip) is tested through the manager, test_checkpoint_manager.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

from s3ckpt.background.ranks import Ranks
from s3ckpt.config import S3URI, make_config
from s3ckpt.errors import CheckpointExistsError, StorageError
from s3ckpt.manager import saving as saving_module
from s3ckpt.manager.policy import checkpoint_name
from s3ckpt.manager.saving import Saving

LOCATION = S3URI.parse("s3://bucket/run", require_prefix=False)


class Committed:
    """The committed steps as the save path asks them (no listing)."""

    def __init__(self, steps: set[int], replaced: set[int] | None = None) -> None:
        self.steps, self.replaced = steps, replaced or set()

    def replaces(self, step: int) -> bool:
        return step in self.replaced

    def includes(self, step: int) -> bool:
        return step in self.steps

    def name(self, step: int) -> str:
        return checkpoint_name(step)

    def add(self, steps: list[int]) -> None:
        self.steps.update(steps)


class Retention:
    def __init__(self) -> None:
        self.after: list[str] = []

    def after_commit(self, checkpoint: Any) -> None:
        self.after.append(str(checkpoint))


@pytest.fixture
def saved(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The writers ``dcp.save`` was called with; each save stores 1000 bytes."""
    writers: list[Any] = []

    def save(state: Any, *, storage_writer: Any, **kwargs: Any) -> Metadata:
        writers.append(storage_writer)
        tensor = TensorStorageMetadata(TensorProperties(torch.uint8), torch.Size([1000]), [])
        return Metadata({"w": tensor})

    monkeypatch.setattr(saving_module.dcp, "save", save)
    return writers


def _saving(committed: Committed, **options: Any) -> tuple[Saving, Retention]:
    config = make_config(None, endpoint_url="http://127.0.0.1:9")
    options = {"memory_tier": None, "if_busy": "wait", "overwrite": False,
               "writer_options": {}, "on_saved": None, "max_metrics": 10, **options}  # fmt: skip
    retention = Retention()
    saving = Saving(
        LOCATION,
        config,
        Ranks(None),
        committed,
        retention,
        None,
        None,
        **options,
    )
    return saving, retention


def test_a_sync_save_writes_the_step_and_records_its_commit(saved):
    committed = Committed(set())
    saving, retention = _saving(committed, writer_options={"compression": "zstd"})
    assert saving.save(3, {}, None) is True
    (writer,) = saved
    assert writer.checkpoint_id == "s3://bucket/run/step-0000000003"
    assert writer.overwrite is False and writer.compression is not None
    metrics = saving.settle()
    assert metrics is None  # no background save: nothing in flight to settle
    (recorded,) = saving.ledger.metrics
    assert recorded.step == 3 and recorded.bytes == 1000
    assert committed.steps == {3} and retention.after == ["s3://bucket/run/step-0000000003"]
    assert not saving.busy


def test_a_committed_step_is_saved_again_only_to_replace_it(saved):
    saving, _ = _saving(Committed({3, 4}, replaced={4}))
    assert saving.save(3, {}, None) is False  # committed: kept
    assert saving.save(4, {}, None) is True  # above the step a rollback loaded: replaced
    saving.overwrite = True
    assert saving.save(3, {}, None) is True
    assert [(w.checkpoint_id[-2:], w.overwrite) for w in saved] == [("04", True), ("03", True)]


def test_a_step_committed_by_another_writer_meanwhile_is_not_saved(monkeypatch, caplog):
    def lost(*args: Any, **kwargs: Any) -> None:
        raise CheckpointExistsError("committed meanwhile")

    monkeypatch.setattr(saving_module.dcp, "save", lost)
    saving, retention = _saving(Committed(set()))
    with caplog.at_level(logging.WARNING, logger="s3ckpt.manager"):
        assert saving.save(5, {}, None) is False
    assert "was committed by someone else" in caplog.text
    assert list(saving.ledger.metrics) == [] and retention.after == []

    def failing(*args: Any, **kwargs: Any) -> None:
        raise StorageError("store down")

    monkeypatch.setattr(saving_module.dcp, "save", failing)
    with pytest.raises(StorageError):  # raised as itself, at once in sync mode
        saving.save(5, {}, None)
