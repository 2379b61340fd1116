"""One naming of steps for every reader, and ``keep_last`` after a killed run.

Steps written as ``step-300`` (a ``TieredCheckpointProcess`` script as the quickstart
writes it, a plain ``S3StorageWriter`` loop) are steps to a fresh ``CheckpointManager``:
listed, loaded, pruned. Padded and unpadded names mix, and a step named both ways is
read from the padded name, with a warning naming both. A name that looks like a step but
is not one is logged once per manager, with the reason, and neither the manager nor
``s3ckpt prune`` counts or deletes it: both expire the same names.

``keep_last`` counts committed checkpoints after a crash too: a run SIGKILLed while its
checkpoint process uploads (held there at its first data object, so the kill always
lands mid-upload), then resumed by a fresh process, leaves exactly ``keep_last``; so
does a run killed while it overwrote a committed checkpoint (after a rollback).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from s3_servers import ON_BOTH

import s3ckpt
from s3ckpt import CheckpointManager, S3StorageWriter, catalog

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_step_names_worker.py"
TIMEOUT_S = 300  # a bound on a hang; a run takes seconds

# Loaded first by every interpreter whose PYTHONPATH names its folder: with
# S3CKPT_TEST_HOLD set, the first data object written under that key part never goes out,
# and the process says so on stdout (the checkpoint process shares the trainer's).
HOLD = """\
import os

_hold = os.environ.get("S3CKPT_TEST_HOLD")
if _hold:
    import asyncio

    from s3ckpt.s3.store import ObjectStore

    def _held(method):
        async def held(self, key, *args, **kwargs):
            if _hold in key:
                os.write(1, f"holding {key}\\n".encode())
                await asyncio.sleep(3600)
            return await method(self, key, *args, **kwargs)

        return held

    for _name in ("put", "create_multipart", "upload_part", "try_parts"):
        setattr(ObjectStore, _name, _held(getattr(ObjectStore, _name)))
"""


def environment(local_s3: Any, tmp_path: Path, hold: str | None = None) -> dict[str, str]:
    env = {**os.environ, **local_s3.env()}
    env["AWS_CONFIG_FILE"] = env["AWS_SHARED_CREDENTIALS_FILE"] = str(tmp_path / "none")
    if hold is not None:
        folder = tmp_path / "hold"
        folder.mkdir(exist_ok=True)
        (folder / "sitecustomize.py").write_text(HOLD)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
        env["S3CKPT_TEST_HOLD"] = hold
    return env


def run(env: dict[str, str], *args: str) -> list[str]:
    """The worker to its end; its stdout lines."""
    done = subprocess.run(
        [sys.executable, str(WORKER), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``s3ckpt <args>`` run to its end in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "s3ckpt", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def killed_mid_upload(env: dict[str, str], *args: str) -> list[str]:
    """The worker, SIGKILLed once its checkpoint process holds an upload; its lines."""
    process = subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines: list[str] = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.strip())
            if line.startswith("holding ") or time.monotonic() > deadline:
                break
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    assert lines and lines[-1].startswith("holding "), lines
    return lines


def committed(uri: str, s3_options: dict[str, Any]) -> list[str]:
    return [i.name for i in catalog.list_checkpoints(uri, **s3_options)]


def save_as(uri: str, value: float, s3_options: dict[str, Any]) -> None:
    """A checkpoint at ``uri`` written by a plain ``S3StorageWriter``, as a script does."""
    state = {"w": torch.full((64 * 1024,), value)}
    dcp.save(state, storage_writer=S3StorageWriter(uri, **s3_options))


def latest(env: dict[str, str], uri: str) -> dict[str, Any]:
    (line,) = run(env, "latest", uri)
    return json.loads(line)


# -- steps named by others ----------------------------------------------------------------


def test_a_fresh_manager_resumes_from_the_steps_a_tiered_script_wrote(
    s3_prefix, s3_options, local_s3, tmp_path, shm_root
):
    """The quickstart's ``TieredCheckpointProcess`` script names its S3 checkpoints
    ``step-300``: a manager in a fresh process lists them and loads the newest."""
    env = environment(local_s3, tmp_path)
    run(env, "tiered", s3_prefix, str(shm_root), "100", "200", "300")
    assert committed(s3_prefix, s3_options) == ["step-100", "step-200", "step-300"]
    found = latest(env, s3_prefix)
    assert found["steps"] == [100, 200, 300]
    assert found["loaded"] == 300 and found["value"] == 300.0
    assert found["uri"] == f"{s3_prefix}/step-300"


@ON_BOTH
def test_a_fresh_manager_resumes_from_steps_a_plain_writer_wrote(
    s3_prefix, s3_options, local_s3, tmp_path
):
    # Saved in step order: a lower step committed after a higher one is a rollback, which
    # supersedes the higher one (s3ckpt.catalog.retention). "step-40" < "step-9" as names.
    for step in (5, 9, 40):
        save_as(f"{s3_prefix}/step-{step}", step, s3_options)
    found = latest(environment(local_s3, tmp_path), s3_prefix)
    assert found["steps"] == [5, 9, 40]  # by number, not by name
    assert found["loaded"] == 40 and found["value"] == 40.0


@ON_BOTH
def test_padded_and_unpadded_names_mix(s3_prefix, s3_options, caplog):
    """A step named both ways resolves to the padded name, with a warning naming both."""
    # Committed in step order: a lower step committed after a higher one is a rollback,
    # which supersedes the higher one (s3ckpt.catalog.retention).
    save_as(f"{s3_prefix}/step-100", 100, s3_options)
    state = {"w": torch.zeros(64 * 1024)}
    caplog.set_level(logging.INFO, logger="s3ckpt")
    with CheckpointManager(s3_prefix, async_mode="sync", **s3_options) as manager:
        state["w"].fill_(200)
        assert manager.save(200, state) is True  # the manager's own name
        save_as(f"{s3_prefix}/step-300", -3, s3_options)
        save_as(f"{s3_prefix}/{s3ckpt.step_name(300)}", 300, s3_options)
        assert manager.steps() == [100, 200, 300]
        assert manager.uri_of(100) == f"{s3_prefix}/step-100"
        assert manager.uri_of(200) == f"{s3_prefix}/step-0000000200"
        assert manager.uri_of(300) == f"{s3_prefix}/step-0000000300"
        assert manager.load_latest(state) == 300 and float(state["w"][0]) == 300.0
        manager.load(100, state)
        assert float(state["w"][0]) == 100.0
        assert manager.save(100, state) is False  # committed as step-100: kept
    twice = [r for r in caplog.records if "step 300 is committed as" in r.getMessage()]
    assert len(twice) == 1 and twice[0].levelno == logging.WARNING
    assert "step-0000000300" in twice[0].getMessage() and "step-300" in twice[0].getMessage()
    assert [s3ckpt.step_of(n) for n in committed(s3_prefix, s3_options)] == [100, 200, 300, 300]


def test_names_that_look_like_steps_are_logged_once_and_never_steps(
    s3_prefix, s3_options, local_s3, caplog
):
    """``step-12a`` and ``step-300.hf-source`` (committed), a step folder holding another
    tool's files and an uncommitted save: each is logged once per manager, with why."""
    save_as(f"{s3_prefix}/step-1", 1, s3_options)
    save_as(f"{s3_prefix}/step-12a", 12, s3_options)
    save_as(f"{s3_prefix}/step-300.hf-source", 300, s3_options)
    client, bucket = local_s3.client(), local_s3.bucket
    prefix = s3_prefix.split("/", 3)[3]
    client.put_object(Bucket=bucket, Key=f"{prefix}/step-500/model.safetensors", Body=b"x")
    client.put_object(Bucket=bucket, Key=f"{prefix}/step--1/notes.txt", Body=b"x")
    caplog.set_level(logging.INFO, logger="s3ckpt")
    state = {"w": torch.zeros(64 * 1024)}
    with CheckpointManager(s3_prefix, async_mode="sync", **s3_options) as manager:
        assert manager.steps() == [1]
        assert manager.load_latest(state) == 1
        assert manager.save(2, state) is True
        assert manager.steps() == [1, 2]
    lines = [r for r in caplog.records if r.name.startswith("s3ckpt")]

    def logged(name: str) -> list[logging.LogRecord]:
        return [r for r in lines if f"{name} " in r.getMessage() or f"'{name}'" in r.getMessage()]

    reasons = {
        "step-12a": "step 12 is followed by 'a'",
        "step-300.hf-source": "step 300 is followed by '.hf-source'",
        "step--1": "'step-' is followed by '-1'",
        "step-500": "holds no s3ckpt checkpoint",
    }
    for name, why in reasons.items():
        (record,) = logged(name)  # once, however often the manager listed
        assert why in record.getMessage(), record.getMessage()
    assert logged("step-500")[0].levelno == logging.INFO
    assert logged("step-12a")[0].levelno == logging.WARNING
    assert set(committed(s3_prefix, s3_options)) == {
        "step-1",
        "step-0000000002",
        "step-12a",
        "step-300.hf-source",
    }


def test_prune_and_the_manager_expire_the_same_names(s3_prefix, s3_options, local_s3, tmp_path):
    """One layout under two prefixes (unpadded, padded, a step named twice, two names
    that are not steps), then step 5 as the manager names it: ``CheckpointManager(keep_last=2)``
    saving step 5 on one, the ``s3ckpt prune --keep-last 2`` command after it on the other."""
    layout = [
        "step-1",
        "step-0000000002",
        "step-3",
        "step-0000000003",
        "step-4",
        "step-4.hf-source",
        "step-12a",
    ]
    by_manager, by_prune = f"{s3_prefix}/manager", f"{s3_prefix}/prune"
    for name in layout:
        for prefix in (by_manager, by_prune):
            save_as(f"{prefix}/{name}", 0, s3_options)
    state = {"w": torch.zeros(64 * 1024)}
    with CheckpointManager(by_manager, keep_last=2, async_mode="sync", **s3_options) as manager:
        assert manager.steps() == [1, 2, 3, 4]
        assert manager.save(5, state) is True
    save_as(f"{by_prune}/{s3ckpt.step_name(5)}", 0, s3_options)
    env = environment(local_s3, tmp_path)
    pruned = cli(env, "prune", by_prune, "--keep-last", "2", "--json")
    assert pruned.returncode == 0, pruned.stderr
    report = json.loads(pruned.stdout)
    kept = {k["name"]: k["reason"] for k in report["kept"]}
    assert kept == {
        "step-4": "last 2",
        "step-0000000005": "newest",
        "step-4.hf-source": "not a step",
        "step-12a": "not a step",
    }
    remaining = {"step-4", "step-0000000005", "step-4.hf-source", "step-12a"}
    assert set(committed(by_prune, s3_options)) == remaining
    assert set(committed(by_manager, s3_options)) == remaining
    listed = cli(env, "ls", by_manager, "--json")
    order = [row["name"] for row in json.loads(listed.stdout)]
    steps = [n for n in order if s3ckpt.step_of(n) is not None]
    assert steps == ["step-4", "step-0000000005"]  # ls orders steps by number


# -- keep_last after a killed run -----------------------------------------------------------


def test_keep_last_after_a_save_killed_mid_upload(s3_prefix, s3_options, local_s3, tmp_path):
    """Steps 1-5 committed (retention left 3, 4, 5), SIGKILL while step 6 uploads; the
    resumed run saves 6 again and goes on to 9: exactly 7, 8 and 9 remain."""
    held = environment(local_s3, tmp_path, hold=f"{s3ckpt.step_name(6)}/data/")
    lines = killed_mid_upload(held, "manager", s3_prefix, "100", "3")
    assert [line for line in lines if line.startswith("committed")] == [
        f"committed {s}" for s in range(1, 6)
    ]
    names = [s3ckpt.step_name(s) for s in (3, 4, 5)]
    assert committed(s3_prefix, s3_options) == names
    listed = catalog.list_checkpoints(s3_prefix, include_uncommitted=True, **s3_options)
    assert [(i.name, i.committed) for i in listed][-1] == (s3ckpt.step_name(6), False)

    time.sleep(1.1)  # the resumed commit lands in a later second than the dead record
    resumed = run(environment(local_s3, tmp_path), "manager", s3_prefix, "9", "3")
    assert resumed[0] == "resumed 5"
    assert committed(s3_prefix, s3_options) == [s3ckpt.step_name(s) for s in (7, 8, 9)]


def test_prune_after_a_save_killed_mid_upload(s3_prefix, s3_options, local_s3, tmp_path):
    """A run without retention killed while step 2 uploads, resumed up to 4: the dead
    save's record in the step 2 the resumed run committed is no save in flight to ``ls``
    or to ``s3ckpt prune --keep-last 2``, which deletes 1 and 2."""
    held = environment(local_s3, tmp_path, hold=f"{s3ckpt.step_name(2)}/data/")
    killed_mid_upload(held, "manager", s3_prefix, "100", "none")
    time.sleep(1.1)
    env = environment(local_s3, tmp_path)
    assert run(env, "manager", s3_prefix, "4", "none")[0] == "resumed 1"
    listed = catalog.list_checkpoints(s3_prefix, **s3_options)
    assert [(i.name, i.in_flight) for i in listed] == [
        (s3ckpt.step_name(s), False) for s in (1, 2, 3, 4)
    ]
    pruned = cli(env, "prune", s3_prefix, "--keep-last", "2", "--json")
    assert pruned.returncode == 0, pruned.stderr
    deleted = [d["name"] for d in json.loads(pruned.stdout)["deleted"]]
    assert deleted == [s3ckpt.step_name(1), s3ckpt.step_name(2)]
    assert committed(s3_prefix, s3_options) == [s3ckpt.step_name(s) for s in (3, 4)]


def test_keep_last_after_an_overwrite_killed_mid_upload(s3_prefix, s3_options, local_s3, tmp_path):
    """Steps 1-5 committed (3, 4, 5 kept); a rollback to 3 is SIGKILLed while it saves
    4 over the abandoned run's 4. Its in-flight record stays fresh for minutes in a
    committed checkpoint; the resumed run (from 5: nothing superseded it) still keeps
    exactly 3."""
    env = environment(local_s3, tmp_path)
    run(env, "manager", s3_prefix, "5", "3")
    assert committed(s3_prefix, s3_options) == [s3ckpt.step_name(s) for s in (3, 4, 5)]
    held = environment(local_s3, tmp_path, hold=f"{s3ckpt.step_name(4)}/data/")
    lines = killed_mid_upload(held, "manager", s3_prefix, "100", "3", "3")
    assert lines[0] == "resumed 3" and "staged 4" in lines
    (four,) = [
        i for i in catalog.list_checkpoints(s3_prefix, **s3_options) if i.name.endswith("04")
    ]
    assert four.in_flight  # the dead overwrite's record, fresh for LEASE_S

    time.sleep(1.1)
    resumed = run(env, "manager", s3_prefix, "8", "3")
    assert resumed[0] == "resumed 5"
    assert committed(s3_prefix, s3_options) == [s3ckpt.step_name(s) for s in (6, 7, 8)]
