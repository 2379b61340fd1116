"""README.md's and docs/cli.md's code, run as written against the embedded server.

README.md's ``python`` blocks define everything they use: they run as written, in order,
twice in a row against the same store, each run in a fresh interpreter
(``_docs_runner.py``: each block in a namespace of its own, so a name or an import a block
lacks fails here as it would for a reader). The second run resumes where the first left
off (its manager restores a step and saves none twice, its ``dcp.load`` finds the step the
first run saved), and a future any block created that failed fails the test. Then every
``s3ckpt`` command of the ``sh`` blocks runs as typed (``make`` lines are the suite's own).
docs/cli.md's Python runs once, from the checkpoints its earlier sections' commands made.
The endpoint the text names (``https://flashblade.example.com``, ``https://fb.example.com``,
``endpoint_url=...``) is the server's, and its buckets (``bucket``, ``archive``, ``ckpt``)
exist there; that is the only change made to the text. docs/quickstart.md has its own test
(``test_quickstart.py``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from _docs_runner import assert_whole, run_blocks

from s3ckpt.testing.local_s3 import LocalS3Server

ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDERS = ("https://flashblade.example.com", "https://fb.example.com")

# The checkpoints and the file docs/cli.md's Python examples start from (made by its
# earlier sections' commands there).
CLI_SETUP = """
import torch
import torch.distributed.checkpoint as dcp
from s3ckpt import S3StorageWriter

for step in (100, 200):
    state = {"model": {"weight": torch.full((4, 8), float(step))}, "step": step}
    dcp.save(state, storage_writer=S3StorageWriter(f"s3://ckpt/run1/step-{step}"))
torch.save({"weight": torch.ones(4, 8)}, "pytorch_model.bin")
"""


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def named(path: str, code: list[str], endpoint: str) -> list[tuple[str, str]]:
    return [(f"{path}, python block {i}", as_run_here(c, endpoint)) for i, c in enumerate(code, 1)]


def as_run_here(code: str, endpoint: str) -> str:
    for placeholder in PLACEHOLDERS:
        code = code.replace(placeholder, endpoint)
    return code.replace("endpoint_url=...", f"endpoint_url={endpoint!r}")


def s3ckpt_commands(text: str, endpoint: str) -> list[list[str]]:
    lines = (line for block in blocks(text, "sh") for line in block.splitlines())
    return [
        shlex.split(as_run_here(line, endpoint), comments=True)
        for line in lines
        if line.startswith("s3ckpt ")
    ]


class Reader:
    """A reader's shell: the server's ``AWS_*`` environment, a working folder of its own."""

    def __init__(self, server: LocalS3Server, cwd: Path) -> None:
        self.endpoint = server.endpoint_url
        self.cwd = cwd
        self.env = {
            **os.environ,
            **server.env(),
            "AWS_CONFIG_FILE": str(cwd / "none"),
            "AWS_SHARED_CREDENTIALS_FILE": str(cwd / "none"),
        }

    def python(self, code: str) -> None:
        self._run(["-c", as_run_here(code, self.endpoint)], code, timeout=300)

    def blocks(self, path: str, code: list[str]) -> list[dict]:
        """One run of ``code``'s blocks in a fresh interpreter (``_docs_runner.py``)."""
        return run_blocks(named(path, code, self.endpoint), env=self.env, cwd=self.cwd)

    def s3ckpt(self, *args: str) -> str:
        return self._run(["-m", "s3ckpt", *args], f"s3ckpt {shlex.join(args)}", timeout=120)

    def _run(self, argv: list[str], what: str, *, timeout: float) -> str:
        done = subprocess.run(
            [sys.executable, *argv],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.cwd,
        )
        assert done.returncode == 0, f"{what}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        return done.stdout


@pytest.fixture
def reader(tmp_path: Path):
    with LocalS3Server(["bucket", "archive", "ckpt"]) as server:
        yield Reader(server, tmp_path)


@pytest.mark.timeout(600)  # two runs of every example, then the commands
def test_the_readme_runs_as_written_twice(reader: Reader) -> None:
    text = (ROOT / "README.md").read_text()
    code, commands = blocks(text, "python"), s3ckpt_commands(text, reader.endpoint)
    assert len(code) == 2 and len(commands) == 10
    first = reader.blocks("README.md", code)
    assert_whole(first, resumed=False)
    assert first[0]["futures"] == 1 and first[1]["saved"] == [0, 100, 200]
    second = reader.blocks("README.md", code)
    assert_whole(second, resumed=True)
    assert second[0]["futures"] == 0  # the dcp example loaded what the first run saved
    assert second[1]["restored"] == [200] and second[1]["saved"] == []
    reader.python("import torch; torch.save({'weight': torch.ones(2, 2)}, 'pytorch_model.bin')")
    for command in commands:
        reader.s3ckpt(*command[1:])
    assert json.loads(reader.s3ckpt("ls", "s3://bucket/run1", "--json")) == []  # rm took it
    listed = json.loads(reader.s3ckpt("ls", "s3://bucket/run2", "--json"))
    assert [row["name"] for row in listed] == [
        "step-0000000000",
        "step-0000000100",
        "step-0000000200",
    ]  # the manager's saves
    assert (reader.cwd / "hf" / "model.safetensors").exists()
    shown = json.loads(reader.s3ckpt("show", "s3://archive/run1/step-100", "--json"))
    assert shown["items"]
    assert json.loads(reader.s3ckpt("ls", "s3://bucket/imported", "--json"))[0]["name"] == "step-0"


def test_the_cli_guides_python_runs_as_written(reader: Reader) -> None:
    code = blocks((ROOT / "docs" / "cli.md").read_text(), "python")
    assert len(code) == 2
    reader.python(CLI_SETUP)
    assert_whole(reader.blocks("docs/cli.md", code), resumed=False)
    names = [row["name"] for row in json.loads(reader.s3ckpt("ls", "s3://ckpt/run1", "--json"))]
    assert names == ["step-200"]  # remove_checkpoint took step-100
    assert json.loads(reader.s3ckpt("ls", "s3://archive/run1", "--json"))[0]["name"] == "step-200"
    assert (reader.cwd / "llama-hf" / "model.safetensors").exists()
    imported = json.loads(reader.s3ckpt("ls", "s3://ckpt/imported", "--json"))
    assert [row["name"] for row in imported] == ["step-0"]


def test_the_runs_fail_on_a_dropped_failed_future_and_on_a_name_from_another_block(
    reader: Reader,
) -> None:
    """What the runs above rest on: a future a block never checked, failed, is reported;
    a block sees no name another block defined."""
    dropped = """
import torch
import torch.distributed.checkpoint as dcp
from s3ckpt import S3StorageWriter

state, uri = {"w": torch.ones(4)}, "s3://bucket/drop/step-1"
dcp.async_save(state, storage_writer=S3StorageWriter(uri)).result()
dcp.async_save(state, storage_writer=S3StorageWriter(uri))  # fails (committed), dropped
"""
    report = run_blocks([("dropped", dropped)], env=reader.env, cwd=reader.cwd)
    assert report[0]["futures"] == 2
    assert len(report[0]["failed"]) == 1 and "CheckpointExistsError" in report[0]["failed"][0]
    with pytest.raises(AssertionError, match="a save failed"):
        assert_whole(report, resumed=False)
    blocks = [("defines", "import json\nsteps = 3\n"), ("uses", "print(json.dumps(steps))\n")]
    with pytest.raises(AssertionError, match="NameError: name 'json' is not defined"):
        run_blocks(blocks, env=reader.env, cwd=reader.cwd)
