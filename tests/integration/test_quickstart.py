"""docs/quickstart.md, run as written against the embedded server.

Every ``python`` block runs in a fresh interpreter, in order, after a preamble that
defines what the text leaves to the reader (a model, an optimizer, a training step) and
nothing else: no module is imported for a block, so a block that uses ``torch`` without
importing it fails here as it would for a reader who copied it;
every ``s3ckpt`` command of the ``sh`` blocks runs as typed. A ``py`` block is shown
only here: it needs an environment of its own or several ranks, and its trainer's own test
runs it (torchtitan: ``test_torchtitan.py``; Megatron-core: ``test_megatron.py``;
DeepSpeed: ``test_deepspeed.py``; Lightning's sharded strategies under torchrun:
``test_lightning_sharded.py``); so do DLIO's ``yaml`` workload and ``bash`` command
(``test_dlio.py``, which runs ``dlio_benchmark`` with them as written). The store is
``s3ckpt local-s3 --bucket ckpt``'s: its ``AWS_*`` variables stand in for the
FlashBlade ``export`` lines, and installing is the test run's own.
"""

from __future__ import annotations

import contextlib
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

from s3ckpt.testing.local_s3 import LocalS3Server

pytestmark = [pytest.mark.integration]

QUICKSTART = Path(__file__).resolve().parents[2] / "docs" / "quickstart.md"
PREAMBLE = """
def _left_to_the_reader():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step(step):
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, train_step


model, optimizer, train_step = _left_to_the_reader()
total_steps = 201
del _left_to_the_reader
"""


@contextlib.contextmanager
def shared_memory_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="s3ckpt-quickstart-", dir="/dev/shm"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", QUICKSTART.read_text(), re.S | re.M)


def _commands() -> list[list[str]]:
    lines = (line for block in _blocks("sh") for line in block.splitlines())
    return [shlex.split(line, comments=True) for line in lines if line.startswith("s3ckpt ")]


def test_the_quickstart_runs_as_written(tmp_path: Path) -> None:
    assert _blocks("python") and _commands()
    with LocalS3Server(["ckpt"]) as server, shared_memory_root() as memory_root:
        env = {
            **os.environ,
            **server.env(),
            "AWS_CONFIG_FILE": str(tmp_path / "none"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
            "S3CKPT_MEMORY_ROOT": str(memory_root),  # the memory tier's, removed after
        }
        for block in _blocks("python"):
            done = subprocess.run(
                [sys.executable, "-c", "\n".join([PREAMBLE, block])],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                cwd=tmp_path,
            )
            assert done.returncode == 0, f"{block}\n{done.stderr[-3000:]}"
        for command in _commands():
            done = subprocess.run(
                [sys.executable, "-m", "s3ckpt", *command[1:]],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, f"{shlex.join(command)}\n{done.stderr}"
        listed = subprocess.run(
            [sys.executable, "-m", "s3ckpt", "ls", "s3://ckpt/run1", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        names = [row["name"] for row in __import__("json").loads(listed.stdout)]
        assert names == ["step-0000000000", "step-0000000100", "step-0000000200"]
