"""A case forked from the zygote ends as the same case in a fresh interpreter does: its
argv, environment, output, exit status, traceback, atexit handlers and threads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.zygote import Zygote

pytestmark = pytest.mark.subprocess
ROOT = Path(__file__).resolve().parents[3]
CASE = """
import atexit, os, sys, threading, time

if __name__ == "__main__":
    print("ran", __name__, sys.argv[1:], os.environ.get("CASE_VALUE"), sys.stdin.read() == "")
    how = sys.argv[1]
    if how == "exit":
        sys.exit(3)
    if how == "raise":
        raise ValueError("boom")
    if how == "atexit":
        atexit.register(print, "at exit")
        threading.Thread(target=lambda: (time.sleep(0.2), print("thread done"))).start()
    if how == "hang":
        time.sleep(600)
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "zygote_case.py").write_text(CASE)
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}


def test_a_forked_case_ends_as_a_fresh_interpreter_does(env: dict[str, str]) -> None:
    with Zygote("zygote_case", env, preload=("json.decoder", "json.dumps")) as zygote:
        for how in ("plain", "exit", "raise", "atexit"):
            case_env = {**env, "CASE_VALUE": how.upper()}
            forked = zygote.run([how, "x"], case_env, timeout=60)
            fresh = subprocess.run(
                [sys.executable, "-m", "zygote_case", how, "x"], env=case_env,
                stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout), how
            assert forked.stdout.startswith(f"ran __main__ ['{how}', 'x'] {how.upper()} True")
            assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:], how
    assert fresh.stdout.endswith("thread done\nat exit\n")


def test_a_case_past_its_timeout_is_killed_and_the_next_runs(env: dict[str, str]) -> None:
    with Zygote("zygote_case", env) as zygote:
        with pytest.raises(subprocess.TimeoutExpired):
            zygote.run(["hang"], env, timeout=1)
        assert zygote.run(["exit"], env, timeout=60).returncode == 3


def test_a_package_runs_its_main_and_each_case_sees_what_the_import_wrote(
    env: dict[str, str], tmp_path: Path
) -> None:
    """``python -m package`` runs ``package.__main__`` over the package the zygote imported
    (its module state shared by the commands, as ``python -m s3ckpt`` needs), and what the
    import wrote to stderr starts each case's stderr, as a fresh interpreter's import writes
    it; cases that end at once (a pid and an exit status in one read) answer one by one."""
    package = tmp_path / "zygote_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("import sys\nsys.stderr.write('imported\\n')\n")
    (package / "__main__.py").write_text(
        "import sys, zygote_pkg\nprint('main', sys.argv[1:])\nsys.exit(int(sys.argv[1]))\n"
    )
    with Zygote("zygote_pkg", env) as zygote:
        for code in range(5):
            forked = zygote.run([str(code)], env, timeout=60)
            fresh = subprocess.run(
                [sys.executable, "-m", "zygote_pkg", str(code)], env=env,
                stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert (forked.returncode, forked.stdout, forked.stderr) == (
                fresh.returncode, fresh.stdout, fresh.stderr,
            )  # fmt: skip
            assert (forked.returncode, forked.stderr) == (code, "imported\n")
