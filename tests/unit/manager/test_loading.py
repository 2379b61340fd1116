"""Loading: the manager's load path (which step, the reader it makes, what a load leaves)."""

from __future__ import annotations

from typing import Any

import pytest

from s3ckpt.background.ranks import Ranks
from s3ckpt.config import S3URI, make_config
from s3ckpt.errors import CheckpointError, StorageError
from s3ckpt.manager import loading as loading_module
from s3ckpt.manager.loading import Loading
from s3ckpt.manager.policy import checkpoint_name

LOCATION = S3URI.parse("s3://bucket/run", require_prefix=False)


class Committed:
    """The committed steps as the load path asks them (no listing)."""

    def __init__(self, steps: list[int], names: dict[int, str] | None = None) -> None:
        self.steps, self.names = steps, names or {}
        self.went_on_from: list[int] = []

    def current(self) -> list[int]:
        return list(self.steps)

    def name(self, step: int) -> str:
        return self.names.get(step, checkpoint_name(step))

    def resolve(self, step: int) -> str:
        return self.name(step)

    def loaded(self, step: int) -> None:
        self.went_on_from.append(step)


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The readers ``dcp.load`` was called with."""
    readers: list[Any] = []
    monkeypatch.setattr(
        loading_module.dcp,
        "load",
        lambda state, storage_reader, **k: readers.append(storage_reader),
    )
    return readers


def _loading(committed: Committed, **options: Any) -> Loading:
    config = make_config(None, endpoint_url="http://127.0.0.1:9")
    options = {"strict": False, "reader_options": {}, **options}
    return Loading(LOCATION, config, Ranks(None), committed, None, **options)


def test_nothing_committed_loads_nothing(loads):
    loading = _loading(Committed([]))
    assert loading.load_latest({}) is None
    assert loads == [] and loading.last_restore is None


def test_the_latest_step_is_loaded_from_s3_and_the_run_goes_on_from_it(loads):
    committed = Committed([3, 5], names={5: "step-5"})  # 5 written by another tool
    loading = _loading(committed, strict=True, reader_options={"trust_pickles": True})
    assert loading.load_latest({}) == 5
    (reader,) = loads
    assert reader.checkpoint_id == "s3://bucket/run/step-5"
    assert reader.strict is True
    assert loading.last_restore is not None and loading.last_restore.tier == "s3"
    assert loading.last_restore.step == 5
    assert committed.went_on_from == [5]
    assert loading.uri_of(5) == "s3://bucket/run/step-5"


def test_a_failed_load_raises_an_s3ckpt_error_and_goes_on_from_nothing(monkeypatch):
    def failing(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("planner refused")

    monkeypatch.setattr(loading_module.dcp, "load", failing)
    committed = Committed([3])
    loading = _loading(committed)
    with pytest.raises(CheckpointError, match="loading s3://bucket/run/step-0000000003 failed"):
        loading.load(3, {})
    assert committed.went_on_from == []

    def store_failing(*args: Any, **kwargs: Any) -> None:
        raise StorageError("gone")

    monkeypatch.setattr(loading_module.dcp, "load", store_failing)
    with pytest.raises(StorageError):  # an s3ckpt error is raised as itself
        loading.load(3, {})
