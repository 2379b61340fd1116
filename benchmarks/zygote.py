"""``python -m MODULE ARGV`` many times over, each a process forked from one that imported it.

A benchmark runs each case in a process of its own (its own CPU time and peak RSS), and a
fresh interpreter spends seconds importing torch before the case starts. :class:`Zygote`
starts one interpreter (``python -m benchmarks.zygote MODULE [PRELOAD...]``) that imports
``MODULE`` and what its cases import when they run (``PRELOAD``: modules, or names such as
``s3ckpt.CheckpointManager``) once, then forks a child per case: each case still runs in a
process of its own, as ``MODULE`` run as ``__main__`` (runpy, as ``-m`` does) with the
case's argv, environment and captured output, ending as that process would (SystemExit's
code, a traceback on stderr for an uncaught exception, atexit handlers and non-daemon
threads waited for). The benchmarks take ``--fork-cases`` for their smoke runs; without it
each case starts a fresh interpreter. ``MODULE`` is imported in the zygote, so its import
only defines: its work runs under ``if __name__ == "__main__"``, as the benchmarks' case
modules do.

The zygote reads one case a line on stdin (JSON: ``argv``, ``env``, ``out``, ``err``, the
paths of the case's stdout and stderr), and writes the child's pid, then its exit status,
a line each, on stdout.
"""

from __future__ import annotations

import importlib
import io
import itertools
import json
import os
import pkgutil
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class Zygote:
    """Runs ``python -m module ARGV`` as a child forked from one interpreter that imported
    ``module`` and ``preload``; :meth:`run` answers as :func:`subprocess.run` with ``capture_output`` and
    ``text`` does. Close it (or use it as a context manager) to end the interpreter."""

    def __init__(
        self, module: str, env: dict[str, str] | None = None, preload: tuple[str, ...] = ()
    ) -> None:
        self.module = module
        self._numbers = itertools.count()
        self._folder = tempfile.TemporaryDirectory(prefix="s3ckpt-zygote-")
        self._pending = b""
        self._process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.zygote", module, *preload],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
        )  # fmt: skip

    def run(
        self, args: list[str], env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """``python -m module *args`` with ``env``; TimeoutExpired (the child killed) after
        ``timeout`` seconds."""
        # Files of its own per case: a process the case started may outlive it, writing.
        number = next(self._numbers)
        out, err = (Path(self._folder.name, f"{number}.{kind}") for kind in ("out", "err"))
        command = {"argv": args, "env": env, "out": str(out), "err": str(err)}
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(command).encode() + b"\n")
        pid = int(self._line(timeout))
        try:
            code = int(self._line(timeout))
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            self._line(timeout)  # the zygote reaps the child and says so
            raise
        return subprocess.CompletedProcess(
            [sys.executable, "-m", self.module, *args], code, out.read_text(), err.read_text()
        )

    def _line(self, timeout: float) -> str:
        """The zygote's next line, waited for at most ``timeout`` seconds (read from its
        pipe unbuffered: a pid and an exit status may come in one read)."""
        stdout = self._process.stdout
        assert stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([stdout], [], [], left)[0]:
                raise subprocess.TimeoutExpired(f"python -m {self.module}", timeout)
            chunk = os.read(stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the zygote for {self.module} exited ({self._process.wait()})")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        """Ends the zygote (EOF on its stdin; killed if it has not ended a minute later)
        and removes the cases' output files."""
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()
        self._folder.cleanup()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve() -> dict[str, Any] | None:
    """Forks a child per case line; returns the case in the child, None at EOF."""
    for line in sys.stdin:
        command = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return command
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
    return None


def _become(module: str, command: dict[str, Any], imported: str) -> None:
    """The child: the case's environment and argv, stdin closed, stdout and stderr to its
    files."""
    os.environ.clear()
    os.environ.update(command["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, command["out"]), (2, command["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115  the process's own, as at start-up
    sys.stderr.write(imported)  # what a fresh interpreter's imports would write again
    sys.argv = [module, *command["argv"]]
    if not hasattr(sys.modules[module], "__path__"):  # a package runs its __main__ instead
        sys.modules.pop(module)  # run afresh as ``__main__``, as in a fresh interpreter


def _preload(module: str, names: list[str]) -> str:
    """Imports ``module`` and ``names`` (modules, or names they hold: a lazy one imports its
    module); what the imports wrote to stderr."""
    written, sys.stderr = sys.stderr, io.StringIO()
    try:
        importlib.import_module(module)
        for name in names:
            pkgutil.resolve_name(name)
        return sys.stderr.getvalue()
    finally:
        sys.stderr = written


if __name__ == "__main__":
    _module = sys.argv[1]
    sys.path[0] = os.getcwd()  # where ``python -m`` looks first
    _imported = _preload(_module, sys.argv[2:])
    _command = _serve()
    if _command is not None:
        _become(_module, _command, _imported)
        runpy.run_module(_module, run_name="__main__", alter_sys=True)
