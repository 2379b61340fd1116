"""What the ``cli`` fixtures of the interop tests return: ``s3ckpt`` run in-process against
the test's server, credentials from the ``AWS_*`` environment as an operator would have them;
and ``python -m s3ckpt`` in a child process, alone or forked from one that imported it once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from benchmarks.zygote import Zygote
from s3ckpt.cli.main import main


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def runner(
    local_s3: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Any,
) -> Callable[..., Result]:
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    for name, value in local_s3.env().items():
        monkeypatch.setenv(name, value)

    def run(*argv: str) -> Result:
        capsys.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse: usage errors
            code = exc.code if isinstance(exc.code, int) else 2
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return run


def _operator_env(server: Any, tmp_path: Any) -> dict[str, str]:
    """The environment of an operator's command: the server's ``AWS_*`` and no config files."""
    return {
        **os.environ,
        **server.env(),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }


def entry_point(server: Any, tmp_path: Any, *argv: str) -> Result:
    """``python -m s3ckpt ARGV`` in a child process, as an operator runs it: what reaches
    stderr there (no test harness catching log records) is what is checked."""
    done = subprocess.run(
        [sys.executable, "-m", "s3ckpt", *argv],
        env=_operator_env(server, tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return Result(done.returncode, done.stdout, done.stderr)


class ForkedCommands:
    """``python -m s3ckpt ARGV`` as :func:`entry_point` runs it, each command a child process
    of its own with its own environment, stdout and stderr, forked from one process that
    imported the command line once (:class:`benchmarks.zygote.Zygote`): a module's commands
    pay for that import once instead of once each. A context manager."""

    # s3ckpt/__main__.py's import, then what the commands import when they run.
    COMMAND_MODULES = ("s3ckpt.cli.main", "s3ckpt.catalog", "s3ckpt.interop.copy")

    def __init__(self) -> None:
        self._zygote = Zygote("s3ckpt", preload=self.COMMAND_MODULES)

    def __enter__(self) -> ForkedCommands:
        return self

    def __exit__(self, *exc: object) -> None:
        self._zygote.close()

    def run(self, server: Any, tmp_path: Any, *argv: str, timeout: float = 120) -> Result:
        """The command's exit status, stdout and stderr; killed after ``timeout`` seconds
        (``subprocess.TimeoutExpired``), as :func:`entry_point`'s would be."""
        try:
            done = self._zygote.run(list(argv), _operator_env(server, tmp_path), timeout)
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(["python", "-m", "s3ckpt", *argv], timeout) from None
        return Result(done.returncode, done.stdout, done.stderr)
