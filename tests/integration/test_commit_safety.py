"""A checkpoint reported committed is complete and stays loadable, on every store.

Racing writers on a store without conditional writes, ``gc`` running during saves, a
rollback, stores that lack ListMultipartUploads, unreadable manifests: each is played out
against the embedded server, behind the fault proxy where a store's behaviour is
simulated.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _commit_race_worker import ELEMENTS, race, state_of
from faultproxy import FaultProxy, Rule
from racing_writers import one_winner, outcomes, running

from s3ckpt import CheckpointManager, IncompleteSaveError, catalog, unwrap
from s3ckpt.cli.main import main as cli_main
from s3ckpt.config import S3URI, make_config
from s3ckpt.format.manifest import MANIFEST_NAME

WRITERS = 3
ROUNDS = 6


@pytest.fixture
def opts(s3_options: dict[str, Any]) -> dict[str, Any]:
    return {"config": make_config(None, **s3_options)}


def _load(make_reader: Any, uri: str, elements: int = ELEMENTS) -> torch.Tensor:
    restored = {"w": torch.zeros(elements)}
    dcp.load(restored, storage_reader=make_reader(uri))
    return restored["w"]


# -- 1 and 4: racing writers on a store without conditional writes ---------------------------


@pytest.mark.timeout(600)
def test_racing_writer_processes_without_conditional_writes_have_exactly_one_winner(
    local_s3: Any, s3_prefix: str, s3_options: dict[str, Any], make_reader: Any, list_keys: Any
) -> None:
    """Conditional headers answered 501 and PUTs held up to 1.5 s at random: every round,
    exactly one writer commits, the others get CommitConflictError and delete what they
    wrote, and the checkpoint holds the winner's bytes."""
    spawn = multiprocessing.get_context("spawn")
    rule = Rule("delay", rate=0.7, methods=("PUT",), per_request=None)
    with FaultProxy(local_s3.endpoint_url, seed=11, delay_s=1.5, conditional="reject") as proxy:
        proxy.add(rule)
        options = {**s3_options, "endpoint_url": proxy.endpoint_url}
        barrier, results = spawn.Barrier(WRITERS), spawn.Queue()
        workers = [
            spawn.Process(target=race, args=(n, ROUNDS, s3_prefix, options, barrier, results))
            for n in range(WRITERS)
        ]
        with running(workers):
            ended_rounds = outcomes(results, WRITERS * ROUNDS, timeout_s=300)
        assert proxy.counts["conditional_refused"] >= 1  # the writers had to fall back
        assert proxy.counts["delay"] > 0
    for number in range(ROUNDS):
        winner = one_winner(number, ended_rounds[number])
        uri = f"{s3_prefix}/round-{number}"
        assert torch.equal(_load(make_reader, uri), state_of(winner)["w"]), number
        manifest = catalog.show_checkpoint(uri, config=make_config(None, **s3_options))
        # Losers removed their objects; no claim and no in-flight record is left.
        assert list_keys(uri) == sorted([*manifest.all_keys(), MANIFEST_NAME]), number


# -- 2: gc during saves ------------------------------------------------------------------------


def test_gc_in_a_loop_never_breaks_a_save(
    s3_prefix: str, make_writer: Any, make_reader: Any, opts: dict[str, Any]
) -> None:
    """An operator's cron job, ``gc --older-than 0s --force``, runs throughout: every save
    commits, and every committed checkpoint loads."""
    stop, collected = threading.Event(), []

    def gc_loop() -> None:
        while not stop.is_set():
            report = catalog.collect_garbage(s3_prefix, grace=0, **opts)
            collected.append(report)

    thread = threading.Thread(target=gc_loop)
    thread.start()
    try:
        sizes = [4_000, 1_500_000, 300_000, 3_000_000, 50_000, 2_000_000]
        for step, elements in enumerate(sizes):
            state = {"w": torch.full((elements,), float(step))}
            dcp.save(
                state, storage_writer=make_writer(f"{s3_prefix}/step-{step}", part_size=5 << 20)
            )
    finally:
        stop.set()
        thread.join(timeout=120)
    assert len(collected) >= 3
    assert any(r.in_flight for r in collected)  # gc saw saves running and left them alone
    for step, elements in enumerate(sizes):
        loaded = _load(make_reader, f"{s3_prefix}/step-{step}", elements)
        assert torch.equal(loaded, torch.full((elements,), float(step)))


def test_a_save_missing_an_object_at_commit_fails_and_leaves_nothing(
    local_s3: Any, s3_prefix: str, make_writer: Any, list_keys: Any
) -> None:
    writer = make_writer(s3_prefix)
    original = writer.finish

    def finish_after_a_deletion(metadata: Any, results: Any) -> None:
        location = S3URI.parse(s3_prefix)
        data = [k for k in list_keys(s3_prefix) if k.startswith("data/")]
        local_s3.client().delete_object(Bucket=location.bucket, Key=location.key(data[0]))
        original(metadata, results)

    writer.finish = finish_after_a_deletion  # type: ignore[method-assign]
    with pytest.raises(BaseException) as raised:
        dcp.save({"w": torch.ones(10_000)}, storage_writer=writer)
    error = unwrap(raised.value)
    assert isinstance(error, IncompleteSaveError) and "missing" in str(error)
    assert list_keys(s3_prefix) == []  # no manifest, no objects, no in-flight record


# -- 3: overwrite during loads -----------------------------------------------------------------


def test_loads_during_a_loop_of_overwrites_always_succeed(
    s3_prefix: str, make_writer: Any, make_reader: Any
) -> None:
    elements = 200_000
    dcp.save({"w": torch.full((elements,), 1.0)}, storage_writer=make_writer(s3_prefix))
    stop, seen, errors = threading.Event(), set(), []

    def poll() -> None:
        while not stop.is_set():
            try:
                values = set(_load(make_reader, s3_prefix, elements).unique().tolist())
                assert len(values) == 1, values
                seen.update(values)
            except BaseException as exc:  # every failure counts
                errors.append(unwrap(exc))
                return

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        for value in (2.0, 3.0, 4.0, 5.0, 6.0):
            state = {"w": torch.full((elements,), value)}
            dcp.save(state, storage_writer=make_writer(s3_prefix, overwrite=True))
    finally:
        stop.set()
        thread.join(timeout=60)
    assert errors == []
    assert len(seen) >= 2 and seen <= {1.0, 2.0, 3.0, 4.0, 5.0, 6.0}


# -- 5 and 8: the manager after a restart and after a rollback ----------------------------------


def test_a_manager_resumed_with_load_skips_a_step_committed_by_the_earlier_run(
    s3_prefix: str, s3_options: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    state = {"w": torch.ones(100)}
    with CheckpointManager(s3_prefix, async_mode="sync", **s3_options) as first:
        assert first.save(300, state) is True
    with CheckpointManager(s3_prefix, async_mode="sync", **s3_options) as resumed:
        resumed.load(300, state)
        with caplog.at_level("INFO", logger="s3ckpt.manager"):
            assert resumed.save(300, state) is False
    assert "step-0000000300 is already committed" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_rollback_supersedes_the_dead_runs_later_steps(
    s3_prefix: str, s3_options: dict[str, Any], opts: dict[str, Any], cli_capture: Any
) -> None:
    """A dead run left step 400; the new run resumes from 300 and commits 310 and 320: a
    restart resumes from 320, retention (keep_last=2) removes 400, ls marks it first."""
    state = {"w": torch.zeros(100)}
    with CheckpointManager(s3_prefix, async_mode="sync", **s3_options) as dead:
        for step in (100, 200, 300, 400):
            dead.save(step, {"w": torch.full((100,), float(step))})
    time.sleep(1.1)  # commit times have a resolution of a second on many stores
    with CheckpointManager(s3_prefix, async_mode="sync", **s3_options) as rollback:
        rollback.load(300, state)
        assert rollback.save(310, {"w": torch.full((100,), 310.0)})
        assert rollback.steps() == [100, 200, 300, 310]
        listing = cli_capture("ls", s3_prefix)
        assert "step-0000000400" in listing and "superseded by step-0000000310" in listing
        assert catalog.committed_names(s3_prefix, **opts)["step-0000000400"] == "step-0000000310"
    with CheckpointManager(s3_prefix, async_mode="sync", keep_last=2, **s3_options) as restart:
        assert restart.load_latest(state) == 310 and torch.equal(
            state["w"], torch.full((100,), 310.0)
        )
        restart.save(320, {"w": torch.full((100,), 320.0)})
        restart.wait()
        assert restart.steps() == [310, 320]
    names = [i.name for i in catalog.list_checkpoints(s3_prefix, **opts)]
    assert names == ["step-0000000310", "step-0000000320"]


def test_a_step_retention_removed_after_a_rollback_is_saved_when_reached_again(
    s3_prefix: str, s3_options: dict[str, Any]
) -> None:
    """The first save after the rollback lists the dead run's 400; its commit supersedes
    400 and retention removes it: reaching 400 again must save it, not skip it."""
    with CheckpointManager(s3_prefix, async_mode="sync", **s3_options) as dead:
        for step in (300, 400):
            dead.save(step, {"w": torch.full((100,), float(step))})
    time.sleep(1.1)  # commit times have a resolution of a second on many stores
    state = {"w": torch.zeros(100)}
    with CheckpointManager(s3_prefix, keep_last=5, **s3_options) as rollback:
        rollback.load(300, state)
        assert rollback.save(310, {"w": torch.full((100,), 310.0)}) is True
        rollback.wait()
        assert rollback.steps() == [300, 310]  # 400 removed by retention
        assert rollback.save(400, {"w": torch.full((100,), 401.0)}) is True
        rollback.wait()
        assert rollback.steps() == [300, 310, 400]
    with CheckpointManager(s3_prefix, **s3_options) as restart:
        assert restart.load_latest(state) == 400
    assert torch.equal(state["w"], torch.full((100,), 401.0))


def test_after_a_rollback_the_abandoned_runs_steps_are_saved_over(
    s3_prefix: str, s3_options: dict[str, Any]
) -> None:
    """Saving every 100 steps, the run goes back to 300 (a loss spike, say): its saves of
    400 and 500 replace the abandoned run's, so a restart resumes from this run's 500."""
    with CheckpointManager(s3_prefix, **s3_options) as dead:
        for step in (300, 400, 500):
            dead.save(step, {"w": torch.full((100,), float(step))})
    state = {"w": torch.zeros(100)}
    with CheckpointManager(s3_prefix, **s3_options) as rollback:
        rollback.load(300, state)
        for step in (400, 500):
            assert rollback.save(step, {"w": torch.full((100,), step + 1.0)}) is True
        rollback.wait()
        assert rollback.save(500, state) is False  # this run's own commit now
    with CheckpointManager(s3_prefix, **s3_options) as restart:
        assert restart.steps() == [300, 400, 500]
        assert restart.load_latest(state) == 500
    assert torch.equal(state["w"], torch.full((100,), 501.0))


# -- 6 and 7: stores without ListMultipartUploads, unreadable manifests ------------------------


@pytest.fixture
def cli_capture(capsys: pytest.CaptureFixture[str], s3_options: dict[str, Any], monkeypatch: Any):
    """Runs ``s3ckpt`` in-process; returns stdout, and stderr and the exit status on request."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_options["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_options["secret_access_key"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3_options["region"])

    def run(*args: str, endpoint: str | None = None, full: bool = False) -> Any:
        code = cli_main([*args, "--endpoint-url", endpoint or s3_options["endpoint_url"]])
        out, err = capsys.readouterr()
        return (code, out, err) if full else out

    return run


def test_a_store_without_list_multipart_uploads_still_lists_and_collects(
    local_s3: Any, s3_prefix: str, make_writer: Any, list_keys: Any, cli_capture: Any
) -> None:
    dcp.save({"w": torch.ones(100)}, storage_writer=make_writer(f"{s3_prefix}/step-1"))
    location = S3URI.parse(s3_prefix)
    client = local_s3.client()
    stale = location.key("step-2/data/r00000-00000000000000aa-0000.bin")
    client.put_object(Bucket=location.bucket, Key=stale, Body=b"x" * 10)
    with FaultProxy(local_s3.endpoint_url) as proxy:
        proxy.add(Rule("not_implemented", methods=("GET",), match="?uploads", per_request=None))
        code, out, err = cli_capture(
            "ls", s3_prefix, "--all", endpoint=proxy.endpoint_url, full=True
        )
        assert code == 0 and "step-1" in out and "step-2" in out, err
        assert "cannot list multipart uploads" in err and "lifecycle" in err
        code, out, err = cli_capture(
            "gc", s3_prefix, "--older-than", "0s", "--force", endpoint=proxy.endpoint_url, full=True
        )
        assert code == 0 and "delete uncommitted" in out
        assert "cannot list multipart uploads" in err
        assert proxy.counts["not_implemented"] >= 2
    assert [k for k in list_keys(s3_prefix) if k.startswith("step-2")] == []


def test_ls_details_marks_an_unreadable_manifest_and_lists_the_rest(
    local_s3: Any, s3_prefix: str, make_writer: Any, cli_capture: Any
) -> None:
    for step in (1, 2, 3):
        dcp.save({"w": torch.ones(10)}, storage_writer=make_writer(f"{s3_prefix}/step-{step}"))
    location = S3URI.parse(s3_prefix)
    local_s3.client().put_object(
        Bucket=location.bucket, Key=location.key(f"step-2/{MANIFEST_NAME}"), Body=b"{not json"
    )
    code, out, err = cli_capture("ls", s3_prefix, "--details", full=True)
    assert code == 1
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(rows) == {"step-1", "step-2", "step-3"}
    assert "damaged" in rows["step-2"] and "committed" in rows["step-3"]
    assert "step-2" in err and "unreadable manifest" in err


def test_gc_refuses_a_short_grace_unless_forced(s3_prefix: str, cli_capture: Any) -> None:
    code, _, err = cli_capture("gc", s3_prefix, "--older-than", "1m", full=True)
    assert code == 2 and "safe minimum" in err and "--force" in err
    code, _, _ = cli_capture("gc", s3_prefix, "--older-than", "1m", "--force", full=True)
    assert code == 0
