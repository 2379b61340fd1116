"""``python -m s3ckpt ARGV`` many times over from one process that imports the command once.

Run as ``python _cli_zygote.py``: it imports what ``python -m s3ckpt`` imports and what its
commands import when they run (:data:`COMMAND_MODULES`), then reads
one command a line on stdin (JSON: ``argv``, ``env``, ``out``, ``err``, file paths for the
command's stdout and stderr), forks, and writes the child's pid and then its exit status,
a line each, on stdout. The child takes the command's environment and output files and
runs ``s3ckpt`` as ``__main__`` (runpy, as ``-m`` does), ending as that process would:
SystemExit's code, a traceback on stderr for an uncaught exception, atexit handlers and
non-daemon threads waited for. What the import itself wrote to stderr is written again at
the start of each command's stderr, since a fresh ``python -m s3ckpt`` would write it too.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import runpy
import sys
from typing import Any

# s3ckpt/__main__.py's import, then what the commands import when they run.
COMMAND_MODULES = (
    "s3ckpt.cli.main",
    "s3ckpt.catalog",
    "s3ckpt.interop.copy",
)

sys.path[0] = os.getcwd()  # where ``python -m`` looks first, instead of this file's folder
_imported = io.StringIO()
sys.stderr, _stderr = _imported, sys.stderr
try:
    for _name in COMMAND_MODULES:
        importlib.import_module(_name)
finally:
    sys.stderr = _stderr


def _serve() -> dict[str, Any] | None:
    """Forks a child per command line; returns the command in the child, None at EOF."""
    for line in sys.stdin:
        command = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return command
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
    return None


def _become(command: dict[str, Any]) -> None:
    """The child: the command's environment, stdin closed, stdout and stderr to its files."""
    os.environ.clear()
    os.environ.update(command["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, command["out"]), (2, command["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115  the process's own, as at start-up
    sys.stderr.write(_imported.getvalue())
    sys.argv = ["s3ckpt", *command["argv"]]


_command = _serve()
if _command is not None:
    _become(_command)
    runpy.run_module("s3ckpt", run_name="__main__", alter_sys=True)
