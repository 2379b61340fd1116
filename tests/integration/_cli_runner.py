"""What the ``cli`` fixtures of the interop tests return: ``s3ckpt`` run in-process against
the test's server, credentials from the ``AWS_*`` environment as an operator would have them;
and ``python -m s3ckpt`` in a child process, alone or forked from one that imported it once."""

from __future__ import annotations

import itertools
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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
    imported the command line once (``_cli_zygote.py``): a module's commands pay for that
    import once instead of once each. A context manager."""

    ZYGOTE = Path(__file__).with_name("_cli_zygote.py")

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._numbers = itertools.count()
        self._pending = b""
        self._zygote = subprocess.Popen(
            [sys.executable, str(self.ZYGOTE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )

    def __enter__(self) -> ForkedCommands:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._zygote.stdin is not None
        self._zygote.stdin.close()  # it ends at the end of its input
        try:
            self._zygote.wait(30)
        except subprocess.TimeoutExpired:
            self._zygote.kill()
            self._zygote.wait()

    def run(self, server: Any, tmp_path: Any, *argv: str, timeout: float = 120) -> Result:
        """The command's exit status, stdout and stderr; killed after ``timeout`` seconds
        (``subprocess.TimeoutExpired``), as :func:`entry_point`'s would be."""
        number = next(self._numbers)
        out, err = self._folder / f"{number}.out", self._folder / f"{number}.err"
        command = {
            "argv": list(argv),
            "env": _operator_env(server, tmp_path),
            "out": str(out),
            "err": str(err),
        }
        assert self._zygote.stdin is not None
        self._zygote.stdin.write(json.dumps(command).encode() + b"\n")
        pid = int(self._line(30))
        try:
            code = int(self._line(timeout))
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            self._line(30)  # reaped
            raise subprocess.TimeoutExpired(["python", "-m", "s3ckpt", *argv], timeout) from None
        return Result(code, out.read_text(), err.read_text())

    def _line(self, timeout: float) -> str:
        """The zygote's next line of output, waited for at most ``timeout`` seconds."""
        assert self._zygote.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._zygote.stdout], [], [], left)[0]:
                raise subprocess.TimeoutExpired("_cli_zygote.py", timeout)
            chunk = os.read(self._zygote.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"_cli_zygote.py exited ({self._zygote.wait()})")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode()
