"""docs/quickstart.md, run as written against the embedded server, twice.

The quickstart opens with a prelude, a ``python`` block that defines what the examples
leave to the reader (a model, an optimizer, a training step, the number of steps). Every
other ``python`` block runs after it as written, in order, in a namespace holding only
those four names (``_docs_runner.py``): no module is imported for a block, so a block that
uses ``torch`` or a name of another block fails here as it would for a reader who pasted
the prelude and that block. The blocks run twice in a row against the same store and the
same node memory, each run in a fresh interpreter: the second run, given 100 more steps,
resumes where the first left off (every restore finds a step, no step is saved twice) and
goes on. A future any block created that failed fails the test, checked or not by the
block. Then every ``s3ckpt`` command of the ``sh`` blocks runs as typed (``s3ckpt
local-s3`` is the test's own server).

A ``py`` block is shown only here: it needs an environment of its own or several ranks,
and its trainer's own test runs it (torchtitan: ``test_torchtitan.py``; Megatron-core:
``test_megatron.py``; DeepSpeed: ``test_deepspeed.py``; Lightning's sharded strategies under
torchrun: ``test_lightning_sharded.py``); so do DLIO's ``yaml`` workload and ``bash``
command (``test_dlio.py``, which runs ``dlio_benchmark`` with them as written). The store
is ``s3ckpt local-s3 --bucket ckpt``'s: its ``AWS_*`` variables stand in for the
FlashBlade ``export`` lines, and installing is the test run's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _docs_runner import assert_whole, run_blocks

from s3ckpt.testing.local_s3 import LocalS3Server

QUICKSTART = Path(__file__).resolve().parents[2] / "docs" / "quickstart.md"
# What the prelude supplies to every block: the names the quickstart leaves to the reader.
SUPPLIED = ("model", "optimizer", "train_step", "total_steps")
MORE_STEPS = 100  # the second run's


@contextlib.contextmanager
def shared_memory_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="s3ckpt-quickstart-", dir="/dev/shm"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def python_blocks(text: str) -> list[tuple[str, str]]:
    """Each ``python`` block with a name: the file, its first line and its section."""
    found = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        line = text.count("\n", 0, match.start()) + 2
        headings = re.findall(r"^#+ (.*)$", text[: match.start()], re.M)
        found.append((f"docs/quickstart.md:{line} ({headings[-1]})", match.group(1)))
    return found


def commands(text: str) -> list[list[str]]:
    blocks = re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M)
    lines = (line for block in blocks for line in block.splitlines())
    return [
        shlex.split(line, comments=True)
        for line in lines
        if line.startswith("s3ckpt ") and not line.startswith("s3ckpt local-s3")
    ]


@pytest.mark.timeout(600)  # two runs of every example: about 2 minutes on a quiet 2-core host
def test_the_quickstart_runs_as_written_twice(tmp_path: Path) -> None:
    text = QUICKSTART.read_text()
    (_, prelude), *blocks = python_blocks(text)
    for name in SUPPLIED:  # the prelude supplies what the blocks are given, no more
        assert re.search(rf"^(def )?{name}\b", prelude, re.M), name
    assert blocks and commands(text)
    with LocalS3Server(["ckpt"]) as server, shared_memory_root() as memory_root:
        env = {
            **os.environ,
            **server.env(),
            "AWS_CONFIG_FILE": str(tmp_path / "none"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
            "S3CKPT_MEMORY_ROOT": str(memory_root),  # the memory tier's, removed after
        }
        runs = {"prelude": prelude, "supplied": SUPPLIED}
        first = run_blocks(blocks, env=env, cwd=tmp_path, **runs)
        assert_whole(first, resumed=False)
        second = run_blocks(blocks, env=env, cwd=tmp_path, extra_steps=MORE_STEPS, **runs)
        assert_whole(second, resumed=True)
        saved = [(entry["block"], entry["saved"]) for entry in second if entry["saved"]]
        assert saved and all(min(steps) > 200 for _, steps in saved), saved  # went on
        for command in commands(text):
            done = subprocess.run(
                [sys.executable, "-m", "s3ckpt", *command[1:]],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                cwd=tmp_path,
            )
            assert done.returncode == 0, f"{shlex.join(command)}\n{done.stderr}"
        listed = subprocess.run(
            [sys.executable, "-m", "s3ckpt", "ls", "s3://ckpt/run1", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        names = [row["name"] for row in json.loads(listed.stdout)]
        assert names == ["step-0000000100", "step-0000000200", "step-0000000300"]  # keep_last=3
