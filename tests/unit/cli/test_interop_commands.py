"""The cp, export and import subcommands' parsing, and the CLI's torch wall at run time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from s3ckpt.cli.commands import READ_TIMEOUT_S
from s3ckpt.cli.interop_commands import TRANSFER_READ_TIMEOUT_S
from s3ckpt.cli.main import build_parser


def test_transfer_commands_wait_longer_for_silent_requests() -> None:
    parser = build_parser()
    cp = parser.parse_args(["cp", "s3://a/b", "s3://c/d"])
    export = parser.parse_args(["export", "s3://a/b", "out", "--max-shard-size", "2GiB"])
    imported = parser.parse_args(["import", "model.safetensors", "s3://a/b"])
    assert cp.read_timeout == export.read_timeout == imported.read_timeout
    assert cp.read_timeout == TRANSFER_READ_TIMEOUT_S > READ_TIMEOUT_S
    assert parser.parse_args(["ls", "s3://a"]).read_timeout == READ_TIMEOUT_S
    assert export.max_shard_size == 2 * 2**30 and export.format == "safetensors"
    assert export.window == 256 * 2**20
    assert (
        parser.parse_args(["cp", "s3://a/b", "s3://c/d", "--read-timeout", "5s"]).read_timeout == 5
    )


@pytest.mark.subprocess  # a fresh interpreter, to see what it imports
def test_the_cli_and_cp_start_without_torch() -> None:
    """Only export and import load torch, inside their run functions."""
    code = (
        "import sys\n"
        "from s3ckpt.cli.main import build_parser\n"
        "build_parser().parse_args(['cp', 's3://a/b', 's3://c/d'])\n"
        "import s3ckpt.interop.copy, s3ckpt\n"
        "s3ckpt.copy_checkpoint\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
