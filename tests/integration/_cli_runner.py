"""What the ``cli`` fixtures of the interop tests return: ``s3ckpt`` run in-process against
the test's server, credentials from the ``AWS_*`` environment as an operator would have them."""

from __future__ import annotations

import json
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
