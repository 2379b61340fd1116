"""The checkpoint process ready before the first save, never starved, fast to close.

What a trainer relies on: the manager starts its checkpoint process at construction
without waiting for it, and ``prepare()`` says when it is ready (imports done, S3 client
made, priority lowered), so the first save finds it ready; a process that cannot start
is reported by ``prepare()`` and by the first save, never a hang; a save beside busy
processes at the trainer's priority completes; ``close()`` with nothing in flight ends
the process at once (killed while it is still starting, exiting when asked once ready);
a script that exits without closing leaves no process behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _fresh_script import run_script, script_env
from liveness import alive

from s3ckpt import CheckpointManager, CheckpointProcess, CheckpointProcessError, catalog
from s3ckpt.background.process import default_niceness

pytestmark = pytest.mark.subprocess


def state_of(seed: int, mib: int = 4) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    n = mib * 1024 * 1024 // 4 // 4
    return {"model": {f"w{i}": torch.randn(n, generator=g) for i in range(4)}, "step": seed}


def loaded_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def shm_of(pids: list[int]) -> list[str]:
    """Entries of /dev/shm whose names carry one of ``pids`` (torch's and Python's own
    shared-memory names do)."""
    return [name for name in os.listdir("/dev/shm") if any(str(pid) in name for pid in pids)]


def test_the_process_is_ready_before_the_first_save(s3_prefix, s3_options, monkeypatch):
    """Constructed, the manager's process starts in the background; ``prepare()``
    returns once it has imported what a save runs and lowered its priority, before any
    save was made."""
    monkeypatch.delenv("S3CKPT_CHECKPOINT_NICE", raising=False)
    with CheckpointManager(s3_prefix, **s3_options) as manager:
        process = manager._saves.process
        pid = process.pid
        assert alive(pid)
        manager.prepare(timeout_s=120)
        assert process.ready
        assert "libtorch" in loaded_libraries(pid)  # imported before the first save
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        for thread in Path(f"/proc/{pid}/task").iterdir():
            lowered = min(19, mine + default_niceness())
            assert os.getpriority(os.PRIO_PROCESS, int(thread.name)) == lowered
        assert manager.save(1, state_of(1)) is True
        assert manager.wait() is not None
        assert process.pid == pid  # the save ran in the process prepared
        assert manager.steps() == [1]
    assert not alive(pid)


def test_prepare_in_thread_mode_returns_at_once(s3_prefix, s3_options):
    with CheckpointManager(s3_prefix, async_mode="thread", **s3_options) as manager:
        manager.prepare(timeout_s=0)


def test_a_process_that_cannot_start_is_reported_by_prepare_and_the_save(
    s3_prefix, s3_options, monkeypatch, tmp_path
):
    """A checkpoint process that dies as it starts (here: a ``torch`` it cannot import)
    is an error at ``prepare()`` and at the first save's outcome, never a wait; once the
    cause is gone, the next save starts a process that saves."""
    broken = tmp_path / "broken"
    (broken / "torch").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(broken), path])))
    manager = CheckpointManager(s3_prefix, **s3_options)
    try:
        with pytest.raises(CheckpointProcessError, match=r"exited with status 1"):
            manager.prepare(timeout_s=120)
        assert manager.save(1, state_of(1)) is True  # the copy is made; its process fails
        with pytest.raises(CheckpointProcessError, match="checkpoint process"):
            manager.wait()
        if path is None:
            monkeypatch.delenv("PYTHONPATH")
        else:
            monkeypatch.setenv("PYTHONPATH", path)
        assert manager.save(1, state_of(1)) is True
        manager.wait()
        assert manager.steps() == [1]
    finally:
        manager.close()


def test_prepare_gives_up_after_its_timeout(s3_prefix, s3_options):
    with CheckpointManager(s3_prefix, **s3_options) as manager:
        if not manager._saves.process.ready:  # it starts in seconds: not in a millisecond
            with pytest.raises(CheckpointProcessError, match="not ready after"):
                manager.prepare(timeout_s=0.001)
        manager.prepare(timeout_s=120)


def test_close_with_nothing_in_flight_ends_the_process_at_once(s3_prefix, s3_options):
    """Closed while still starting, the process is killed (nothing of it to lose); closed
    once ready, it exits by itself when asked (status 0: not killed after a timeout)."""
    starting = CheckpointManager(s3_prefix, **s3_options)
    worker = starting._saves.process._side
    assert not worker.ready  # constructed a moment ago: still importing torch
    starting.close()
    assert worker._popen.returncode == -9
    assert not alive(worker.pid)

    ready = CheckpointManager(s3_prefix, **s3_options)
    ready.prepare(timeout_s=120)
    worker = ready._saves.process._side
    ready.close()
    assert worker._popen.returncode == 0
    assert not alive(worker.pid)


CONSTRUCT_AND_EXIT = """\
import sys
from s3ckpt import CheckpointManager

manager = CheckpointManager(sys.argv[1], endpoint_url=sys.argv[2])
print(manager._saves.process.pid, flush=True)
if sys.argv[3] == "ready":
    manager.prepare(timeout_s=120)
# no close: the interpreter's exit must stop the process
"""


@pytest.mark.parametrize("when", ["starting", "ready"])
def test_a_script_that_exits_without_close_leaves_nothing(
    s3_prefix, s3_options, local_s3, tmp_path, when
):
    done = run_script(
        tmp_path, CONSTRUCT_AND_EXIT, s3_options, s3_prefix, local_s3.endpoint_url, when
    )
    pid = int(done.stdout.split()[0])
    assert not alive(pid)
    assert shm_of([pid]) == []


FIRST_AND_WARM = """\
import json, sys, time, torch
from s3ckpt import CheckpointManager

state = {"model": {f"w{i}": torch.randn(4 * 1024 * 1024) for i in range(4)}}  # 64 MiB
manager = CheckpointManager(sys.argv[1], endpoint_url=sys.argv[2])
manager.prepare(timeout_s=120)
times = []
for step in (1, 2, 3):
    started = time.perf_counter()
    manager.save(step, state)
    manager.wait()
    times.append(time.perf_counter() - started)
pid = manager._saves.process.pid
started = time.perf_counter()
manager.close()
print(json.dumps({"saves": times, "close": time.perf_counter() - started, "pid": pid}))
"""


@pytest.mark.serial
def test_a_prepared_first_save_commits_about_as_fast_as_a_warm_one(
    s3_prefix, s3_options, local_s3, tmp_path
):
    import json

    done = run_script(tmp_path, FIRST_AND_WARM, s3_options, s3_prefix, local_s3.endpoint_url)
    report = json.loads(done.stdout.splitlines()[-1])
    first, *warm = report["saves"]
    assert first <= max(1.5 * min(warm), min(warm) + 0.5), report
    assert report["close"] < 1.0, report
    assert not alive(report["pid"])


BESIDE_BUSY = """\
import sys, torch
from s3ckpt import CheckpointManager

with CheckpointManager(sys.argv[1], endpoint_url=sys.argv[2]) as manager:
    manager.save(1, {"w": torch.randn(1024 * 1024)})  # 4 MiB, before the process is ready
    manager.wait()
"""


@pytest.mark.serial
def test_a_save_beside_two_busy_processes_completes(s3_prefix, s3_options, local_s3, tmp_path):
    """Two processes at the trainer's priority keep the cores busy: the checkpoint
    process, started and saving beside them, still finishes (its start-up runs at the
    trainer's priority, and ``wait()`` runs the save at it where it may)."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        run_script(tmp_path, BESIDE_BUSY, s3_options, s3_prefix, local_s3.endpoint_url, timeout=120)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert catalog.is_committed(f"{s3_prefix}/step-0000000001", **s3_options)


UNPRIVILEGED = """\
import json, os
from pathlib import Path
from s3ckpt import CheckpointProcess
from s3ckpt.background.process import may_raise_priority

with CheckpointProcess() as process:
    process.prepare(timeout_s=120)
    tasks = Path(f"/proc/{process.pid}/task").iterdir()
    nice = sorted({os.getpriority(os.PRIO_PROCESS, int(t.name)) for t in tasks})
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    print(json.dumps({"may_raise": may_raise_priority(), "nice": nice, "mine": mine}))
"""


def test_a_trainer_that_cannot_raise_a_priority_back_saves_at_its_own(
    s3_options, tmp_path, monkeypatch
):
    """Without ``CAP_SYS_NICE`` (and with ``RLIMIT_NICE`` at 0), a priority lowered for
    the upload could not be raised while the trainer waits for it: the process stays at
    the trainer's priority by default."""
    import json

    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to drop CAP_SYS_NICE from a child")
    monkeypatch.delenv("S3CKPT_CHECKPOINT_NICE", raising=False)
    script = tmp_path / "unprivileged.py"
    script.write_text(UNPRIVILEGED)
    done = subprocess.run(
        [setpriv, "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice",
         sys.executable, str(script)],
        capture_output=True, text=True, timeout=240, env=script_env(s3_options), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["may_raise"] is False
    assert report["nice"] == [report["mine"]]


def _nice_of(pid: int) -> set[int]:
    return {
        os.getpriority(os.PRIO_PROCESS, int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()
    }


def _privileged() -> None:
    from s3ckpt.background.process import may_raise_priority

    if not may_raise_priority():
        pytest.skip("the process saves at the trainer's priority where it may not be raised back")


def test_a_save_waited_for_or_beside_full_cores_runs_at_the_trainer_s_priority(monkeypatch):
    """Where the trainer may raise a priority back, its process saves at +10, at the
    trainer's priority while other work fills the cores or the save is waited for, and
    at +10 again once neither holds."""
    _privileged()
    monkeypatch.delenv("S3CKPT_CHECKPOINT_NICE", raising=False)
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    lowered = min(19, mine + 10)
    with CheckpointProcess() as process:
        process.prepare(timeout_s=120)
        worker, pid = process._side, process.pid
        assert _nice_of(pid) == {lowered}
        worker._priority.contended(True)
        assert _nice_of(pid) == {mine}
        worker.hurry()
        worker._priority.contended(False)
        assert _nice_of(pid) == {mine}  # still waited for
        worker.relax()
        assert _nice_of(pid) == {lowered}
        worker.hurry()
        worker.relax()
        assert _nice_of(pid) == {lowered}


@pytest.mark.serial
def test_a_save_beside_processes_filling_the_cores_is_not_starved(s3_prefix, s3_options):
    """More busy processes at the trainer's priority than cores: within about a second
    of demand sampled, the process saving at +10 runs at the trainer's priority (not a
    tenth of a core's share), without anyone waiting for the save; back at +10 after."""
    _privileged()
    from s3ckpt import S3StorageWriter

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    cores = os.cpu_count() or 1
    state = state_of(3, mib=256)
    with CheckpointProcess(nice=10) as process:
        process.prepare(timeout_s=120)
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores + 1)]  # fmt: skip
        try:
            writer = S3StorageWriter(f"{s3_prefix}/busy", **s3_options)
            future = process.async_save(state, storage_writer=writer)
            seen = set()
            while not future.done():  # nobody waits on it: only the contention raises it
                seen |= _nice_of(process.pid)
                time.sleep(0.05)
        finally:
            for p in busy:
                p.kill()
                p.wait()
        future.result()
        assert mine in seen, seen
        ends = time.monotonic() + 5  # the sampler's last look, a fraction of a second
        while _nice_of(process.pid) != {min(19, mine + 10)} and time.monotonic() < ends:
            time.sleep(0.05)
        assert _nice_of(process.pid) == {min(19, mine + 10)}
    assert catalog.is_committed(f"{s3_prefix}/busy", **s3_options)
