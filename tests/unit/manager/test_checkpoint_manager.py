"""CheckpointManager without a store: names, options, metrics, retention choice, and the
save policy (one in flight, wait or skip, failures raised once) against a fake DCP."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from s3ckpt import S3StorageWriter
from s3ckpt.background import saver as saver_module
from s3ckpt.background.saver import state_bytes
from s3ckpt.catalog import CheckpointInfo
from s3ckpt.catalog.run_listing import RunSteps, steps_named
from s3ckpt.catalog.run_retention import retention_victims
from s3ckpt.errors import BucketNotFoundError, CheckpointError, CheckpointExistsError, ConfigError
from s3ckpt.manager import committed as committed_module
from s3ckpt.manager import loading as loading_module
from s3ckpt.manager import saving as saving_module
from s3ckpt.manager.checkpoint_manager import CheckpointManager
from s3ckpt.manager.policy import (
    SaveMetrics,
    checkpoint_name,
    parse_step,
)

NOW = 1_000_000.0
# How long a test waits for the manager's worker thread: a bound on a hang, never reached
# when all is well, so generous that a loaded machine cannot reach it either.
PATIENCE_S = 60.0

# -- names ----------------------------------------------------------------------------------


def test_names_are_zero_padded_so_lexicographic_order_is_step_order():
    steps = [0, 7, 10, 99, 100, 12345, 9_999_999_999]
    names = [checkpoint_name(s) for s in steps]
    assert names[1] == "step-0000000007"
    assert sorted(names) == names
    assert [parse_step(n) for n in names] == steps


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None])
def test_step_must_be_a_non_negative_int(bad):
    with pytest.raises(ConfigError):
        checkpoint_name(bad)


@pytest.mark.parametrize("name", ["best", "step-", "step-1/x", "run2/step-3", "step-1a", "xstep-1"])
def test_only_manager_names_parse(name):
    assert parse_step(name) is None


@pytest.mark.parametrize("name", ["step-42", "step-00042", "step-00000000042"])
def test_any_step_digits_name_is_that_step(name):
    """``step-42`` (another tool's, under the same prefix) is step 42: the manager lists,
    loads and prunes it under that name (:mod:`s3ckpt.catalog.steps`)."""
    assert parse_step(name) == 42


# -- metrics ----------------------------------------------------------------------------------


def test_metrics_throughput_and_dict():
    metrics = SaveMetrics.of(7, blocked=0.25, upload=2.0, nbytes=50_000_000, waited=0.2)
    assert metrics.throughput_mb_s == pytest.approx(25.0)
    assert metrics.as_dict() == {
        "step": 7,
        "blocked_s": 0.25,
        "upload_s": 2.0,
        "bytes": 50_000_000,
        "throughput_mb_s": pytest.approx(25.0),
        "waited_s": 0.2,
        "held_s": None,  # no memory tier
        "to_s3": True,
        "replicated_s": None,
    }
    assert "step-0000000007 committed: 47.7 MiB" in str(metrics)  # s3ckpt.units


def test_state_bytes_sums_the_tensors_dcp_saved():
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    metadata = Metadata(
        {
            "w": TensorStorageMetadata(TensorProperties(torch.bfloat16), torch.Size([4, 8]), []),
            "step": TensorStorageMetadata(TensorProperties(torch.int64), torch.Size([]), []),
            "extra": BytesStorageMetadata(),  # size unknown to the metadata: not counted
        }
    )
    assert state_bytes(metadata) == 4 * 8 * 2 + 8
    assert state_bytes(None) == 0


# -- retention choice ---------------------------------------------------------------------------


def info(name: str, t: float, committed: bool = True) -> CheckpointInfo:
    return CheckpointInfo(name, f"s3://b/run/{name}", committed, t, 1, 1, 1)


def victims(infos, **policy) -> list[str]:
    return retention_victims(infos, now=NOW, **policy)


def test_retention_keeps_last_and_every():
    infos = [info(checkpoint_name(s), s) for s in range(1, 8)]
    deleted = victims(infos, keep_last=2, keep_every=3, protect=checkpoint_name(7))
    assert deleted == [checkpoint_name(s) for s in (1, 2, 4, 5)]


def test_retention_never_deletes_the_checkpoint_just_written_after_a_rollback():
    """Rolled back to 10 and saved 15: the abandoned run's 20 and 30 are the newest."""
    infos = [info(checkpoint_name(s), s) for s in (10, 15, 20, 30)]
    deleted = victims(infos, keep_last=1, keep_every=None, protect=checkpoint_name(15))
    assert deleted == [checkpoint_name(10), checkpoint_name(20)]


def test_retention_ignores_what_the_manager_did_not_name_and_uncommitted_saves():
    infos = [
        info("best", 0),
        info("run2/step-0000000001", 1),
        info(checkpoint_name(1), 1),
        info(checkpoint_name(2), 2, committed=False),
        info(checkpoint_name(3), 3),
    ]
    assert victims(infos, keep_last=1, keep_every=None, protect=checkpoint_name(3)) == [
        checkpoint_name(1)
    ]


def test_keep_every_alone_keeps_multiples_and_the_newest():
    infos = [info(checkpoint_name(s), s) for s in (5, 10, 15, 20, 25)]
    deleted = victims(infos, keep_last=None, keep_every=10, protect=checkpoint_name(25))
    assert deleted == [checkpoint_name(5), checkpoint_name(15)]


# -- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{"if_busy": "queue"}, {"async_mode": "fork"}, {"keep_last": -1}, {"keep_every": 0}],
)
def test_bad_options_fail_at_construction(options):
    with pytest.raises(ConfigError):
        CheckpointManager("s3://bucket/run", **options)


# -- the save policy against a fake DCP ---------------------------------------------------------


class FakeDCP:
    """Stands in for DCP's save on the manager's worker thread (thread mode): each save
    blocks on a future the test completes by hand. ``calls`` lists the checkpoints whose
    writer the manager created, which it does in the caller just before starting a save."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.overwrites: list[bool] = []
        self.futures: list[Future[Any]] = []
        self._changed = threading.Condition()

    def writer(self, uri: str, **options: Any) -> S3StorageWriter:
        self.calls.append(uri)
        self.overwrites.append(options.get("overwrite", False))
        return S3StorageWriter(uri, **options)

    def save(self, state_dict: Any, *, storage_writer: Any, **kwargs: Any) -> Any:
        future: Future[Any] = Future()
        with self._changed:
            self.futures.append(future)
            self._changed.notify_all()
        return future.result()

    def _pending(self, index: int) -> Future[Any]:
        """The save to complete, once the worker has started it."""
        with self._changed:
            assert self._changed.wait_for(
                lambda: any(not f.done() for f in self.futures), timeout=PATIENCE_S
            )
            return self.futures[index]

    def commit(self, index: int = -1, nbytes: int = 1000) -> None:
        """Complete a save whose state was ``nbytes`` of uint8 (what DCP's metadata says)."""
        import torch
        from torch.distributed.checkpoint.metadata import (
            Metadata,
            TensorProperties,
            TensorStorageMetadata,
        )

        tensor = TensorStorageMetadata(TensorProperties(torch.uint8), torch.Size([nbytes]), [])
        self._pending(index).set_result(Metadata({"w": tensor}))

    def fail(self, error: BaseException, index: int = -1) -> None:
        wrapped = CheckpointException("save failed", {0: (error, None)})
        self._pending(index).set_exception(wrapped)


def listing(names: Any) -> Callable[..., RunSteps]:
    """A stand-in for ``catalog.run_steps`` listing ``names`` (name -> the name superseding
    it, or None), or what the function ``names`` returns (or raises) when called."""
    return lambda *a, **k: steps_named(names(*a, **k) if callable(names) else names)


@pytest.fixture
def fake(monkeypatch) -> FakeDCP:
    fake = FakeDCP()
    monkeypatch.setattr(saving_module.dcp, "save", fake.save)  # a synchronous save
    monkeypatch.setattr(saver_module, "save_plain", fake.save)  # the background one
    monkeypatch.setattr(saving_module, "S3StorageWriter", fake.writer)
    monkeypatch.setattr(committed_module.catalog, "run_steps", listing({checkpoint_name(5): None}))
    monkeypatch.setattr(
        committed_module.catalog, "is_committed", lambda uri, **k: uri.endswith(checkpoint_name(5))
    )
    return fake


def wait_until_idle(manager: CheckpointManager) -> None:
    """Until the save's bookkeeping (on the manager's worker thread) has run."""
    deadline = time.monotonic() + PATIENCE_S
    while manager.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not manager.busy


def make(**options: Any) -> CheckpointManager:
    """A thread-mode manager (the policy is the same in every mode; thread mode starts no
    process, and the fake DCP stands in for its ``dcp.save``)."""
    options.setdefault("async_mode", "thread")
    return CheckpointManager("s3://bucket/run", endpoint_url="http://127.0.0.1:9", **options)


def test_save_returns_once_staged_and_names_the_checkpoint(fake):
    manager = make()
    assert manager.save(1, {}) is True
    assert fake.calls == ["s3://bucket/run/step-0000000001"]
    assert manager.busy
    fake.commit(nbytes=2_000_000)
    metrics = manager.wait()
    assert metrics is not None and metrics.step == 1 and metrics.bytes == 2_000_000
    assert list(manager.metrics) == [metrics]
    assert not manager.busy
    manager.close()


def test_a_save_waits_for_the_previous_upload(fake, monkeypatch):
    """Save 1 is committed 0.3 s after save 2 has begun to wait for it (once the manager
    waits, not after a guess of when it will), so the bounds below hold however slow."""
    manager = make()
    manager.save(1, {})
    waiting, committing = threading.Event(), threading.Event()
    settle = manager._saving.settle

    def settle_after_saying_so() -> SaveMetrics | None:
        waiting.set()
        return settle()

    monkeypatch.setattr(manager._saving, "settle", settle_after_saying_so)

    def commit_later() -> None:
        assert waiting.wait(60)
        time.sleep(0.3)
        committing.set()
        fake.commit()

    committer = threading.Thread(target=commit_later)
    committer.start()
    called = time.perf_counter()
    manager.save(2, {})  # blocks until save 1 is committed
    returned = time.perf_counter()
    assert committing.is_set()  # it returned after the commit, not before
    committer.join(60)
    assert len(fake.calls) == 2
    fake.commit()
    metrics = manager.wait()
    assert metrics is not None and metrics.step == 2
    assert 0.3 <= metrics.waited_s <= returned - called
    assert metrics.blocked_s >= metrics.waited_s
    manager.close()


def test_skip_policy_skips_while_busy(fake, caplog):
    manager = make(if_busy="skip")
    manager.save(1, {})
    with caplog.at_level(logging.INFO, logger="s3ckpt.manager"):
        assert manager.save(2, {}) is False
    assert "skipped step-0000000002" in caplog.text
    fake.commit()
    manager.wait()
    assert manager.save(3, {}) is True
    fake.commit()
    manager.close()
    assert fake.calls[-1].endswith("step-0000000003") and len(fake.calls) == 2


def test_options_stay_attributes_a_script_can_change_between_saves(fake, caplog):
    """The constructor's options read back as given, and a change takes effect on the next
    save or load, as the attributes of the same names always did."""
    manager = make(writer_options={"part_size": 8 << 20}, reader_options={"decode_threads": 4})
    assert (manager.if_busy, manager.strict) == ("wait", False)
    assert manager.writer_options == {"part_size": 8 << 20}
    assert manager.reader_options == {"decode_threads": 4}
    manager.strict, manager.reader_options = True, {}
    assert (manager._loading.strict, manager._loading.reader_options) == (True, {})
    manager.writer_options = {}
    assert manager._saving.writer_options == {}
    manager.if_busy = "skip"
    manager.save(1, {})
    with caplog.at_level(logging.INFO, logger="s3ckpt.manager"):
        assert manager.save(2, {}) is False
    assert "skipped step-0000000002" in caplog.text
    fake.commit()
    manager.close()


def test_a_failed_background_save_is_logged_and_raised_once(fake, caplog):
    manager = make()
    manager.save(1, {})
    with caplog.at_level(logging.ERROR, logger="s3ckpt.manager"):
        fake.fail(BucketNotFoundError("no bucket", bucket="bucket"))
        wait_until_idle(manager)
    assert "background save of step-0000000001 failed" in caplog.text
    with pytest.raises(BucketNotFoundError):
        manager.save(2, {})
    assert len(fake.calls) == 1  # the failing call did not start a save
    assert manager.save(2, {}) is True  # raised once only
    fake.commit()
    manager.close()


def test_close_raises_a_pending_failure_and_still_releases(fake):
    manager = make()
    manager.save(1, {})
    fake.fail(RuntimeError("boom"))
    with pytest.raises(CheckpointError, match="RuntimeError: boom") as info:  # s3ckpt's only
        manager.close()
    assert isinstance(info.value.__cause__, RuntimeError)
    manager.close()  # idempotent, nothing left to raise
    with pytest.raises(CheckpointError, match="closed"):
        manager.save(2, {})


def test_existing_steps_are_skipped_unless_overwrite(fake, caplog):
    manager = make()
    assert manager.steps() == [5]
    with caplog.at_level(logging.INFO, logger="s3ckpt.manager"):
        assert manager.save(5, {}) is False
    assert "already committed" in caplog.text and fake.calls == []
    manager.close()
    overwriting = make(overwrite=True)
    overwriting.steps()
    assert overwriting.save(5, {}) is True
    fake.commit()
    overwriting.close()


def test_a_step_committed_by_an_earlier_run_is_skipped_without_listing_first(fake, caplog):
    """A job resumed with load(step) has not listed the run: the store is asked."""
    manager = make()
    with caplog.at_level(logging.INFO, logger="s3ckpt.manager"):
        assert manager.save(5, {}) is False
    assert "step-0000000005 is already committed" in caplog.text and fake.calls == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert manager.save(6, {}) is True
    fake.commit()
    manager.close()


def test_a_step_committed_by_someone_else_is_not_a_failure(fake, caplog):
    manager = make()
    manager.save(4, {})
    with caplog.at_level(logging.WARNING, logger="s3ckpt.manager"):
        fake.fail(CheckpointExistsError("exists"))
    manager.wait()  # does not raise
    assert "committed by someone else" in caplog.text
    assert manager.save(4, {}) is False  # now known to exist
    manager.close()


def test_on_saved_gets_metrics_and_its_errors_do_not_escape(fake, caplog):
    seen: list[SaveMetrics] = []

    def on_saved(metrics: SaveMetrics) -> None:
        seen.append(metrics)
        raise ValueError("callback bug")

    manager = make(on_saved=on_saved)
    manager.save(1, {})
    with caplog.at_level(logging.ERROR, logger="s3ckpt.manager"):
        fake.commit()
    manager.close()
    assert [m.step for m in seen] == [1]
    assert "on_saved callback failed" in caplog.text


def test_retention_runs_after_each_commit_protecting_the_new_step(fake, monkeypatch):
    removed: list[str] = []
    listing = [info(checkpoint_name(s), s) for s in (1, 2)]
    monkeypatch.setattr("s3ckpt.catalog.run_retention.list_checkpoints", lambda *a, **k: listing)
    monkeypatch.setattr(
        "s3ckpt.catalog.run_retention.remove_checkpoint", lambda uri, **k: removed.append(uri)
    )
    manager = make(keep_last=1)
    assert manager.save(3, {}) is True
    listing.append(info(checkpoint_name(3), 3))  # what retention lists once 3 is committed
    fake.commit()
    manager.wait()  # waits for retention too
    assert removed == ["s3://bucket/run/step-0000000001", "s3://bucket/run/step-0000000002"]
    manager.close()


def test_retention_failures_are_logged_not_raised(fake, monkeypatch, caplog):
    def broken(*args: Any, **kwargs: Any) -> None:
        raise BucketNotFoundError("gone")

    monkeypatch.setattr("s3ckpt.catalog.run_retention.list_checkpoints", broken)
    manager = make(keep_last=1)
    manager.save(3, {})
    with caplog.at_level(logging.WARNING, logger="s3ckpt.manager"):
        fake.commit()
        manager.wait()
    manager.close()
    assert "retention after step-0000000003" in caplog.text


def test_busy_flag_tracks_the_upload(fake):
    manager = make()
    assert not manager.busy
    manager.save(1, {})
    assert manager.busy
    fake.commit()
    deadline = time.monotonic() + PATIENCE_S
    while manager.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not manager.busy
    manager.close()


def test_earlier_steps_are_listed_once_not_asked_per_save(fake, monkeypatch):
    listings: list[str] = []

    def listed(uri: str, **kwargs: Any) -> dict[str, str | None]:
        listings.append(uri)
        return {checkpoint_name(5): None}

    heads: list[str] = []

    def head(uri: str, **kwargs: Any) -> bool:
        heads.append(uri)
        return True

    monkeypatch.setattr(committed_module.catalog, "run_steps", listing(listed))
    monkeypatch.setattr(committed_module.catalog, "is_committed", head)
    manager = make()
    assert manager.save(5, {}) is False  # listed, and confirmed with one HEAD
    for step in (6, 7):  # not listed: no request
        assert manager.save(step, {}) is True
        fake.commit()
        manager.wait()
    assert manager.save(6, {}) is False  # committed by this manager
    assert listings == ["s3://bucket/run"]
    assert heads == ["s3://bucket/run/step-0000000005"]
    manager.close()


def test_a_listed_step_deleted_since_is_saved(fake, monkeypatch):
    """Resumed from step 300 with an abandoned step 400 left over: the first save (310)
    lists 400, its commit supersedes 400 and retention deletes it; reaching 400 again
    asks with a HEAD and saves it."""
    present = {checkpoint_name(300), checkpoint_name(400)}
    monkeypatch.setattr(
        committed_module.catalog, "run_steps", listing(lambda *a, **k: dict.fromkeys(present))
    )
    monkeypatch.setattr(
        committed_module.catalog, "is_committed", lambda uri, **k: uri.rsplit("/", 1)[1] in present
    )
    manager = make()
    assert manager.save(310, {}) is True
    fake.commit()
    manager.wait()
    present.discard(checkpoint_name(400))  # retention after the commit of 310
    assert manager.save(400, {}) is True
    fake.commit()
    manager.close()


def test_after_a_rollback_the_steps_above_it_are_saved_over_the_abandoned_run(fake, monkeypatch):
    """After ``load(300)``, 400 and 500 are the abandoned run's: reaching them saves over
    them (a restart must not resume from the run rolled back from), without a request;
    once this run committed them, they are kept like any other."""
    monkeypatch.setattr(
        committed_module.catalog,
        "run_steps",
        listing(dict.fromkeys(checkpoint_name(s) for s in (300, 400, 500))),
    )
    heads: list[str] = []
    monkeypatch.setattr(
        committed_module.catalog, "is_committed", lambda uri, **k: not heads.append(uri)
    )
    monkeypatch.setattr(loading_module.dcp, "load", lambda *a, **k: None)
    manager = make()
    assert manager.save(400, {}) is False  # no load yet: an earlier run's step is kept
    manager.load(300, {})
    assert manager.save(300, {}) is False  # the step loaded: kept
    for step in (400, 500):
        assert manager.save(step, {}) is True
        fake.commit()
        manager.wait()
    assert fake.overwrites == [True, True]
    assert heads == ["s3://bucket/run/step-0000000400", "s3://bucket/run/step-0000000300"]
    assert manager.save(400, {}) is False  # this run's own commit now
    manager.load(300, {})  # rolled back again: this run's 400 is abandoned in turn
    assert manager.save(400, {}) is True and fake.overwrites[-1] is True
    fake.commit()
    manager.close()


def test_a_failed_listing_falls_back_to_a_head_per_save(fake, monkeypatch):
    heads: list[str] = []
    listings: list[int] = []

    def broken(*args: Any, **kwargs: Any) -> None:
        listings.append(1)
        raise BucketNotFoundError("no listing here")

    def head(uri: str, **kwargs: Any) -> bool:
        heads.append(uri)
        return uri.endswith(checkpoint_name(5))

    monkeypatch.setattr(committed_module.catalog, "run_steps", listing(broken))
    monkeypatch.setattr(committed_module.catalog, "is_committed", head)
    manager = make()
    assert manager.save(5, {}) is False
    assert manager.save(6, {}) is True
    fake.commit()
    manager.close()
    assert heads == ["s3://bucket/run/step-0000000005", "s3://bucket/run/step-0000000006"]
    assert listings == [1]  # tried once


@pytest.mark.subprocess  # forks
def test_a_forked_child_gets_a_clear_error_not_a_hang(fake):
    """The worker thread and the save in flight stay in the parent: a child that uses the
    manager is told so, and closing it there waits for nothing."""
    manager = make()
    assert manager.save(1, {}) is True  # in flight while the child runs
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 1
        try:
            manager.save(2, {})
        except CheckpointError as exc:
            code = 0 if "each process creates its own CheckpointManager" in str(exc) else 2
        try:
            manager.close()
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    fake.commit()
    manager.close()
