"""A user's script run in a fresh interpreter, credentials for the test server in its
environment (as a user's shell would hold them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def script_env(s3_options: dict[str, Any]) -> dict[str, str]:
    return {
        **os.environ,
        "AWS_ACCESS_KEY_ID": s3_options["access_key_id"],
        "AWS_SECRET_ACCESS_KEY": s3_options["secret_access_key"],
        "AWS_DEFAULT_REGION": s3_options["region"],
    }


def run_script(
    tmp_path: Path, text: str, s3_options: dict[str, Any], *args: str, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """Run ``text`` as ``train.py`` in ``tmp_path`` with ``args``; it must exit 0 with no
    traceback."""
    script = tmp_path / "train.py"
    script.write_text(text)
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True, text=True, timeout=timeout, env=script_env(s3_options),
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done
