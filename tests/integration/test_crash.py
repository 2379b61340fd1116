"""A saving process SIGKILLed at random moments never leaves anything half-visible.

A saver (forked by ``_crash_worker.py``, which imports torch once) saves a 20 MiB
checkpoint in 5 MiB parts, step after step, and is killed: after a random delay, at a
random part upload, or while it holds the manifest PUT (data and metadata written, commit
not yet). After every kill: only committed checkpoints are listed, the uncommitted ones
cannot be loaded, and every committed one (the previous checkpoint above all) loads
bit-exact. At the end ``gc`` with no grace period leaves exactly the committed
checkpoints' objects and no multipart upload. The counts go to ``docs/reliability.md``.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _crash_worker as worker
import pytest
import reliability_report as report
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import CheckpointNotFoundError, S3StorageReader, S3StorageWriter, catalog
from s3ckpt.config import make_config

HERE = Path(__file__).resolve().parent
TRIALS = 24
MODES = ("random", "upload", "random", "commit")  # 12 random, 6 upload, 6 commit
TITLES = {
    "random": "SIGKILL at a random moment of a save",
    "upload": "SIGKILL as a random part upload starts",
    "commit": "SIGKILL between data and manifest",
}


class Zygote:
    """The worker process: forks savers on request; its output lines arrive on a queue."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        with log.open("wb") as errors:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "_crash_worker.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                env=env,
            )
        self.lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.committed: set[int] = set()
        self.saver: int | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode().strip())
        self.lines.put("eof")

    def next_line(self, deadline: float) -> str | None:
        try:
            line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.001))
        except queue.Empty:
            return None
        if line == "eof":
            raise AssertionError("the crash worker exited; see its log")
        if line.startswith("committed "):
            self.committed.add(int(line.split()[1]))
        return line

    def until(self, word: str, count: int = 1, timeout: float = 60.0) -> str:
        """Read lines until the ``count``-th that starts with ``word``."""
        deadline = time.monotonic() + timeout
        while (line := self.next_line(deadline)) is not None:
            if line.startswith(word):
                count -= 1
                if count == 0:
                    return line
        raise AssertionError(f"no {word!r} line within {timeout}s")

    def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.next_line(deadline)

    def fork(self, line: str) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{line}\n".encode())
        self.proc.stdin.flush()
        self.saver = int(self.until("pid ").split()[1])
        return self.saver

    def kill_saver(self) -> None:
        pid, self.saver = self.saver, None
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            self.until(f"exited {pid}")

    def close(self) -> None:
        try:
            self.kill_saver()
        finally:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def zygote(local_s3, tmp_path) -> Iterator[Zygote]:
    env = {**os.environ, **local_s3.env(), "PYTHONWARNINGS": "ignore"}
    running = Zygote(env, tmp_path / "crash-worker.log")
    try:
        yield running
    finally:
        running.close()


class Trials:
    """Checks the store after each kill and keeps the counts for the fault matrix."""

    def __init__(self, prefix: str, options: dict[str, Any]) -> None:
        self.prefix, self.options = prefix, options
        self.config = make_config(None, **options)
        self.verified: set[int] = set()
        self.rows = {mode: report.Row(TITLES[mode], {"sigkill": 0}, 0) for mode in TITLES}

    def load_exact(self, step: int) -> int:
        restored = worker.blank()
        uri = worker.checkpoint_uri(self.prefix, step)
        dcp.load(restored, storage_reader=S3StorageReader(uri, **self.options))
        expected = worker.state(step)
        assert restored["meta"] == expected["meta"]
        for key in ("ramp", "noise"):
            assert restored[key].view(torch.uint8).equal(expected[key].view(torch.uint8)), key
        return sum(expected[k].numel() * 4 for k in ("ramp", "noise"))

    def check(self, mode: str, held: int | None, reported: set[int]) -> int:
        """After a kill: what is listed is committed and loads; the rest is invisible."""
        listing = catalog.list_checkpoints(
            self.prefix, include_uncommitted=True, config=self.config
        )
        committed = {int(c.name[5:]) for c in listing if c.committed}
        uncommitted = {c.name for c in listing if not c.committed}
        assert reported <= committed
        assert all(c.committed for c in catalog.list_checkpoints(self.prefix, config=self.config))
        for name in uncommitted:
            reader = S3StorageReader(f"{self.prefix}/{name}", **self.options)
            with pytest.raises(CheckpointNotFoundError):
                reader.read_metadata()
        if held is not None:  # killed holding the manifest PUT: data there, commit not
            assert f"step-{held:04d}" in uncommitted
        row = self.rows[mode]
        new = committed - self.verified
        for step in sorted(new | {max(committed)}):  # the newest: "the previous checkpoint"
            row.bytes_verified += self.load_exact(step)
        row.faults["sigkill"] += 1
        row.operations += 1 + len(new)
        row.survived += len(new)
        row.failed_cleanly += 1
        self.verified |= committed
        catalog.prune(self.prefix, keep_last=2, config=self.config)
        return max(committed)


def test_sigkill_at_random_moments_never_leaves_a_partial_checkpoint(
    zygote, local_s3, s3_options, s3_prefix, list_keys, pending_uploads
):
    started = time.monotonic()
    rng = random.Random(20240611)
    trials = Trials(s3_prefix, s3_options)
    dcp.save(
        worker.state(0),
        storage_writer=S3StorageWriter(worker.checkpoint_uri(s3_prefix, 0), **s3_options),
    )
    trials.verified.add(0)
    newest, kinds = 0, Counter[str]()
    for trial in range(TRIALS):
        mode = MODES[trial % len(MODES)]
        first = newest + 1
        zygote.committed.clear()
        zygote.fork(f"{local_s3.endpoint_url} {s3_prefix} {first} {mode}")
        if mode == "random":
            zygote.drain(rng.uniform(0.05, 2.5))
        elif mode == "upload":
            zygote.until("part ", count=rng.randint(1, 8))
        else:
            zygote.until("committing ")
        zygote.kill_saver()
        kinds[mode] += 1
        newest = trials.check(mode, first if mode == "commit" else None, set(zygote.committed))

    # The killed savers are known dead: their in-flight records need not expire first. A
    # fresh record of a dead save kept prune from the directory it wrote into, so prune
    # once more after gc.
    gc = catalog.collect_garbage(s3_prefix, grace=0, lease=0, config=trials.config)
    catalog.prune(s3_prefix, keep_last=2, config=trials.config)
    assert pending_uploads(s3_prefix) == []
    remaining = catalog.list_checkpoints(s3_prefix, include_uncommitted=True, config=trials.config)
    assert all(c.committed for c in remaining) and len(remaining) == 2
    expected = {"/".join((c.name, "manifest.json")) for c in remaining}
    for c in remaining:
        manifest = catalog.show_checkpoint(c.uri, config=trials.config)
        expected |= {f"{c.name}/{key}" for key in manifest.all_keys()}
        trials.load_exact(int(c.name[5:]))
    assert set(list_keys(s3_prefix)) == expected
    elapsed = time.monotonic() - started

    suite = report.Suite(list(trials.rows.values()))
    suite.notes = [
        f"{TRIALS} kills of a process saving 20 MiB checkpoints in 5 MiB parts ("
        + ", ".join(f"{kinds[m]} {TITLES[m].removeprefix('SIGKILL ')}" for m in TITLES)
        + f"), {elapsed:.0f} s in all. Operations: the killed saves plus the saves that "
        "committed meanwhile; every committed checkpoint and, after each kill, the newest "
        "one was loaded and compared. Failed cleanly: after the kill only committed "
        "checkpoints were listed and the killed save's could not be loaded.",
        f"`gc` afterwards (grace 0) aborted {len(gc.uploads)} multipart uploads and deleted "
        f"{gc.objects} objects ({gc.bytes:,} bytes) left by killed saves; what remained was "
        f"exactly the objects of the {len(remaining)} committed checkpoints kept by "
        "`prune --keep-last 2`.",
    ]
    report.record("crash", suite)
