"""What the ``cli`` fixtures of the interop tests return: ``s3ckpt`` run in-process against
the test's server, credentials from the ``AWS_*`` environment as an operator would have them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

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


def entry_point(server: Any, tmp_path: Any, *argv: str) -> Result:
    """``python -m s3ckpt ARGV`` in a child process, as an operator runs it: what reaches
    stderr there (no test harness catching log records) is what is checked."""
    env = {
        **os.environ,
        **server.env(),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "s3ckpt", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return Result(done.returncode, done.stdout, done.stderr)
