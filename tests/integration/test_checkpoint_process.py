"""The checkpoint process (``s3ckpt.background``): one persistent process per rank that
uploads what the training loop copied into shared memory, the manager's default mode.

What a trainer relies on: saves reuse one process and one staging memory; a killed
process fails its save with a clear error, commits nothing and is replaced at the next
save; errors of a save come back as s3ckpt's; closing, or the interpreter's exit with no
close at all, stops the process and leaves no shared memory behind; a script needs no
main guard; several gloo ranks save sharded state through their processes' own group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _checkpoint_process_worker as rank_side
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist_worker import run_ranks
from _process_writers import HeldAfterUpload, StalledInSecondPart
from liveness import alive
from torch.distributed.checkpoint.metadata import Metadata

from s3ckpt import (
    BucketNotFoundError,
    CheckpointManager,
    CheckpointProcess,
    CheckpointProcessError,
    ConfigError,
    catalog,
)

MIB = 1024 * 1024
pytestmark = pytest.mark.subprocess


def state_of(seed: int, n: int = 4) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    weights = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(n)}
    return {"model": weights, "tied": weights["w0"], "step": seed, "ids": torch.arange(7)}


def tensor_bytes(state: dict[str, Any]) -> int:
    """The tensor bytes DCP saves of a :func:`state_of` (the tied tensor under both names)."""
    return sum(t.nbytes for t in state["model"].values()) + state["tied"].nbytes + 7 * 8


def load(uri: str, make_reader, like: dict[str, Any]) -> dict[str, Any]:
    target = {
        "model": {k: torch.zeros_like(v) for k, v in like["model"].items()},
        "tied": torch.zeros_like(like["tied"]),
        "step": -1,
        "ids": torch.zeros_like(like["ids"]),
    }
    dcp.load(target, storage_reader=make_reader(uri))
    return target


def assert_same(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    for name, tensor in saved["model"].items():
        assert torch.equal(loaded["model"][name], tensor), name
    assert torch.equal(loaded["tied"], saved["tied"])
    assert torch.equal(loaded["ids"], saved["ids"])
    assert loaded["step"] == saved["step"]


def test_saves_reuse_one_process_and_its_staging_memory(s3_prefix, make_writer, make_reader):
    with CheckpointProcess() as process:
        pid = process.pid
        assert alive(pid) and pid != os.getpid()
        held, segments = None, None
        for seed in (1, 2, 3):
            state = state_of(seed)
            future = process.async_save(state, storage_writer=make_writer(f"{s3_prefix}/s{seed}"))
            assert isinstance(future.result(timeout=120), Metadata)  # as dcp.async_save
            assert_same(load(f"{s3_prefix}/s{seed}", make_reader, state), state)
            if held is None:
                held, segments = process.staging_bytes, list(process.arena().segments)
            assert process.pid == pid
            assert process.staging_bytes == held  # the same memory, not a new copy
            assert process.arena().segments == segments
        assert held >= 4 * MIB
        bigger = state_of(4, n=80)  # 80 MiB: outgrows the first segment (64 MiB)
        process.async_save(bigger, storage_writer=make_writer(f"{s3_prefix}/big")).result(120)
        assert len(process.arena().segments) == len(segments) + 1
        assert_same(load(f"{s3_prefix}/big", make_reader, bigger), bigger)
    assert not alive(pid)


def test_a_failed_save_raises_its_s3ckpt_error_and_the_process_stays(
    s3_prefix, make_writer, s3_options
):
    with CheckpointProcess() as process:
        pid = process.pid
        writer = make_writer("s3://no-such-bucket-s3ckpt/x")
        future = process.async_save(state_of(1), storage_writer=writer)
        with pytest.raises(BucketNotFoundError):
            future.result(timeout=120)
        ok = process.async_save(state_of(2), storage_writer=make_writer(f"{s3_prefix}/ok"))
        ok.result(timeout=120)
        assert process.pid == pid  # one rank: a save's failure leaves its process alone


def test_a_killed_process_fails_its_save_commits_nothing_and_is_replaced(
    s3_prefix, make_writer, s3_options, tmp_path
):
    marker = tmp_path / "written"
    with CheckpointProcess() as process:
        first = process.pid
        writer = HeldAfterUpload(f"{s3_prefix}/step-1", str(marker), **s3_options)
        future = process.async_save(state_of(1), storage_writer=writer)
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the save never reached the end of its upload"
        os.kill(first, signal.SIGKILL)
        with pytest.raises(CheckpointProcessError, match="killed by signal 9"):
            future.result(timeout=60)
        listed = catalog.list_checkpoints(s3_prefix, include_uncommitted=True, **s3_options)
        assert [(i.name, i.committed) for i in listed] == [("step-1", False)]
        state = state_of(2)
        again = process.async_save(state, storage_writer=make_writer(f"{s3_prefix}/step-2"))
        again.result(timeout=120)
        assert process.pid != first and alive(process.pid)
    committed = catalog.list_checkpoints(s3_prefix, **s3_options)
    assert [i.name for i in committed] == ["step-2"]


def test_a_process_killed_mid_upload_leaves_no_upload_open(
    s3_prefix, s3_options, tmp_path, pending_uploads
):
    """Killed with a multipart upload half sent: the trainer aborts what the dead process
    left open before it reports the failure."""
    marker = tmp_path / "part-2"
    with CheckpointProcess() as process:
        uri = f"{s3_prefix}/step-1"
        writer = StalledInSecondPart(uri, str(marker), **s3_options)
        future = process.async_save({"w": torch.randn(12 * MIB)}, storage_writer=writer)  # 48 MiB
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the upload never reached its second part"
        assert pending_uploads(uri), "the stalled upload should be open"
        os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(CheckpointProcessError) as failed:
            future.result(timeout=120)
        assert "were aborted" in "\n".join(getattr(failed.value, "__notes__", []))
        assert pending_uploads(uri) == []
        assert not catalog.is_committed(uri, **s3_options)


def test_closed_process_is_gone_and_refuses_saves(s3_prefix, make_writer):
    process = CheckpointProcess()
    pid = process.pid
    process.close()
    process.close()  # idempotent
    assert not alive(pid)
    with pytest.raises(CheckpointProcessError, match="closed"):
        process.async_save(state_of(1), storage_writer=make_writer(f"{s3_prefix}/x"))


@pytest.mark.parametrize(
    ("given", "env", "expected"), [(None, None, None), (None, "3", 3), (0, "3", 0)]
)
def test_the_process_yields_the_cores_to_the_trainer(
    s3_prefix, make_writer, monkeypatch, given, env, expected
):
    """The checkpoint process and every thread it starts run at the trainer's nice value
    plus ``nice`` (default ``$S3CKPT_CHECKPOINT_NICE``, else 10 where the trainer may
    raise a priority back, else 0)."""
    from s3ckpt.background.process import default_niceness

    expected = default_niceness() if expected is None else expected
    if env is None:
        monkeypatch.delenv("S3CKPT_CHECKPOINT_NICE", raising=False)
    else:
        monkeypatch.setenv("S3CKPT_CHECKPOINT_NICE", env)
    process = CheckpointProcess(nice=given)
    try:
        writer = make_writer(f"{s3_prefix}/nice")
        process.async_save(state_of(1), storage_writer=writer).result(timeout=120)
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        threads = list(Path(f"/proc/{process.pid}/task").iterdir())
        assert len(threads) > 1  # the interpreter's and the ones its save started
        for thread in threads:
            assert os.getpriority(os.PRIO_PROCESS, int(thread.name)) == min(19, mine + expected)
    finally:
        process.close()


@pytest.mark.parametrize(("given", "env"), [(-1, None), (20, None), (True, None), (None, "x")])
def test_a_bad_niceness_is_refused_before_anything_starts(monkeypatch, given, env):
    if env is not None:
        monkeypatch.setenv("S3CKPT_CHECKPOINT_NICE", env)
    with pytest.raises(ConfigError, match=r"(?i)nice must be an int from 0 to 19"):
        CheckpointProcess(nice=given)


def test_the_manager_saves_from_its_checkpoint_process_by_default(s3_prefix, s3_options):
    state = state_of(5)
    with CheckpointManager(s3_prefix, **s3_options) as manager:
        assert manager.async_mode == "process"
        pid = manager._saves.process.pid
        assert alive(pid) and pid != os.getpid()
        assert manager.save(1, state) is True
        metrics = manager.wait()
        assert metrics is not None and metrics.bytes == tensor_bytes(state)
        assert manager.steps() == [1]
    assert not alive(pid)


def test_a_save_answers_what_its_reply_makes_of_the_metadata_in_the_process(s3_prefix, make_writer):
    """The trainer gets back only what it asks for: the manager asks for the state's
    bytes, so DCP's whole metadata never crosses to it."""
    from s3ckpt.background.saver import state_bytes

    state = state_of(6)
    with CheckpointProcess() as process:
        process.wait_idle()
        process.refresh()
        staged = process.stage(state)
        future = process.submit(staged, make_writer(f"{s3_prefix}/r"), reply=state_bytes)
        assert future.result(timeout=120) == tensor_bytes(state)
        # a reply that fails fails its save with the error, and the process stays
        pid = process.pid
        failing = process.submit(process.stage(state), make_writer(f"{s3_prefix}/f"), reply=len)
        with pytest.raises(CheckpointProcessError, match="has no len"):
            failing.result(timeout=120)
        process.wait_idle()
        process.refresh()
        assert process.pid == pid


SCRIPT = """\
import os, sys, torch
from s3ckpt import CheckpointManager

# top-level code, no main guard, no process group: what a first script looks like
manager = CheckpointManager(sys.argv[1], endpoint_url=sys.argv[2])
state = {"w": torch.randn(512, 1024), "step": 1}
manager.save(1, state)
print(manager._saves.process.pid, flush=True)
# no wait, no close: the interpreter's exit must finish the save and stop the process
"""


@pytest.mark.serial  # compares the whole of /dev/shm before and after
def test_a_script_without_main_guard_or_close_saves_and_exits_cleanly(
    s3_prefix, s3_options, local_s3, tmp_path
):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": s3_options["access_key_id"],
        "AWS_SECRET_ACCESS_KEY": s3_options["secret_access_key"],
        "AWS_DEFAULT_REGION": s3_options["region"],
    }
    shm_before = set(os.listdir("/dev/shm"))
    done = subprocess.run(
        [sys.executable, str(script), s3_prefix, local_s3.endpoint_url],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    pid = int(done.stdout.split()[0])
    assert not alive(pid)
    assert set(os.listdir("/dev/shm")) <= shm_before  # nothing left behind
    assert [i.name for i in catalog.list_checkpoints(s3_prefix, **s3_options)] == [
        "step-0000000001"
    ]


@pytest.mark.distributed
def test_two_ranks_save_dtensors_through_their_processes(local_s3, s3_prefix, s3_options, tmp_path):
    reports = _two_ranks(rank_side.dtensor_main, s3_options, s3_prefix, tmp_path)
    full = rank_side.dtensor_full_state()
    for report in reports:
        assert report["steps"] == [1, 2]
        assert report["same_pid"] and report["same_segments"]
        assert report["loaded_step"] == 2
        for name, tensor in full.items():
            assert torch.equal(report["loaded"][name], tensor * 2), name
            assert torch.equal(report["full"][name], tensor * 2), name
        assert torch.equal(report["plain"], torch.arange(10, dtype=torch.float64))
        assert report["pid_gone"]
    assert reports[0]["pid"] != reports[1]["pid"]


@pytest.mark.distributed
def test_a_rank_whose_process_is_killed_fails_the_save_on_every_rank(
    local_s3, s3_prefix, s3_options, tmp_path
):
    reports = _two_ranks(rank_side.killed_main, s3_options, s3_prefix, tmp_path)
    assert reports[1]["first"].startswith(
        "CheckpointProcessError: the checkpoint process of rank 1"
    )
    assert "killed by signal 9" in reports[1]["first"]
    assert reports[0]["first"].startswith("CheckpointProcessError"), reports[0]["first"]
    _saved_again_by_fresh_processes(reports, [("a", False), ("b", True)])


@pytest.mark.distributed
def test_a_process_killed_while_the_processes_meet_fails_every_rank_at_once(
    local_s3, s3_prefix, s3_options, tmp_path
):
    reports = _two_ranks(rank_side.killed_meeting_main, s3_options, s3_prefix, tmp_path)
    assert reports[1]["first"].startswith(
        "CheckpointProcessError: the checkpoint process of rank 1"
    ), reports[1]["first"]
    assert "killed by signal 9 while meeting its peers" in reports[1]["first"]
    assert reports[0]["first"].startswith(
        "CheckpointProcessError: the checkpoint process of rank 0"
    ), reports[0]["first"]
    assert "(the checkpoint process of rank 1 was killed by signal 9)" in reports[0]["first"]
    _saved_again_by_fresh_processes(reports, [("b", True)])


def _two_ranks(main: Any, s3_options: dict[str, Any], uri: str, tmp_path: Path) -> list[dict]:
    """``main`` run on two ranks to its end: each rank's report."""
    run_ranks(main, 2, s3_options, uri, str(tmp_path), timeout=300)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _saved_again_by_fresh_processes(reports: list[dict], listed: list[tuple[str, bool]]) -> None:
    """After the kill, each rank's next save committed from a new process."""
    for report in reports:
        assert report["second_metadata"] == "Metadata"
        assert report["fresh_pid"]
        assert report["listed"] == listed
