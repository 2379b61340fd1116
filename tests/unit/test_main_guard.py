"""Process-mode saves from a script without ``if __name__ == "__main__":`` fail fast with
a clear message instead of hanging (the spawned checkpoint process reruns the script)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess  # each test runs a script

CONSTRUCT = (
    'CheckpointManager("s3://bucket/run", endpoint_url="http://127.0.0.1:9", async_mode="process")'
)


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text("from s3ckpt import CheckpointManager\n" + textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )


def test_an_unguarded_script_is_told_to_add_the_guard(tmp_path: Path) -> None:
    done = _run(tmp_path, f"{CONSTRUCT}\n")
    assert done.returncode != 0
    assert 'if __name__ == "__main__":' in done.stderr and "train.py" in done.stderr


def test_an_unguarded_call_through_a_function_is_found_too(tmp_path: Path) -> None:
    done = _run(tmp_path, f"def main():\n    {CONSTRUCT}\n\nmain()\n")
    assert 'if __name__ == "__main__":' in done.stderr


@pytest.mark.parametrize(
    "body",
    [
        f'if __name__ == "__main__":\n    {CONSTRUCT}\n',
        f'def main():\n    {CONSTRUCT}\n\nif "__main__" == __name__:\n    main()\n',
    ],
    ids=["guarded", "guarded-call"],
)
def test_a_guarded_script_passes_the_check(tmp_path: Path, body: str) -> None:
    done = _run(tmp_path, body)
    assert "__main__" not in done.stderr.splitlines()[-1]
    assert "gloo" in done.stderr  # the next check: process mode needs a process group
