"""The ``s3ckpt`` command line.

Each subcommand is one :class:`Command` row in :data:`COMMANDS`: a function that adds its
arguments and a function that runs it and returns the exit status. The catalog commands
(ls, show, verify, prune, gc, rm, doctor) live in :mod:`s3ckpt.cli.commands`, cp, export
and import in :mod:`s3ckpt.cli.interop_commands`, memory (the node's memory tier) in
:mod:`s3ckpt.cli.memory_commands`; :func:`main` never changes.

Exit statuses: 0 success; 1 a problem found (damage reported by verify, no committed
checkpoint where one was named, an unreadable manifest); 2 a usage, configuration or
connection error (bad options, unreachable endpoint, denied access, missing bucket, any
store failure). Errors are one line on stderr: ``s3ckpt <command>: error: ...``; with
``--json`` stdout then carries ``{"error": "...", "exit": N}`` (whatever failed: a usage
error, the store, a refusal), so a script always gets a JSON document. A reader that goes
away (``| head``) ends the command quietly. ``s3ckpt --version`` prints the version.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

from s3ckpt._version import __version__
from s3ckpt.cli import commands, interop_commands, memory_commands
from s3ckpt.errors import ConfigError, EndpointError, S3CkptError, StorageError

if TYPE_CHECKING:
    from s3ckpt.s3.loop import CancelScope


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, one-line help, argument setup and body."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# -- local-s3 ----------------------------------------------------------------------------


def _local_s3_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bucket",
        action="append",
        metavar="NAME",
        help="bucket to create (repeatable; default: s3ckpt)",
    )
    parser.add_argument(
        "--dir",
        metavar="PATH",
        help="keep data in PATH across runs (default: a temporary directory, deleted on exit)",
    )


def _local_s3(args: argparse.Namespace) -> int:
    """Run a private S3 server in the foreground until SIGINT/SIGTERM.

    The export lines go to stdout (paste them into another shell, or parse them);
    progress goes to stderr. Printing the secret is deliberate: it is the user's own
    throwaway server on 127.0.0.1.
    """
    from s3ckpt.testing.local_s3 import DEFAULT_BUCKET, LocalS3Server

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with LocalS3Server(args.bucket or DEFAULT_BUCKET, data_dir=args.dir) as server:
            env = server.env()
            for name in (
                "AWS_ACCESS_KEY_ID",
                "AWS_SECRET_ACCESS_KEY",
                "AWS_DEFAULT_REGION",
                "AWS_ENDPOINT_URL",
            ):
                print(f"export {name}={shlex.quote(env[name])}")
            for bucket in server.buckets:
                print(f"# bucket: s3://{bucket}")
            sys.stdout.flush()
            print(
                f"s3ckpt: local S3 on {server.endpoint_url} (data: {server.data_dir}); "
                "Ctrl-C to stop",
                file=sys.stderr,
                flush=True,
            )
            while not stop.wait(0.5):
                if not server.running:
                    print(
                        f"s3ckpt: the S3 server exited unexpectedly:\n{server.log_tail()}",
                        file=sys.stderr,
                    )
                    return 1
        print("s3ckpt: local S3 stopped", file=sys.stderr)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


COMMANDS: tuple[Command, ...] = (
    Command(
        "local-s3",
        "run a private S3 server (SeaweedFS) on 127.0.0.1",
        _local_s3_arguments,
        _local_s3,
    ),
    Command(
        "ls",
        "list the checkpoints under a prefix, oldest first",
        commands.ls_arguments,
        commands.run_ls,
    ),
    Command(
        "show",
        "show a checkpoint's manifest and every item",
        commands.show_arguments,
        commands.run_show,
    ),
    Command(
        "verify",
        "re-read a checkpoint and check every size and checksum",
        commands.verify_arguments,
        commands.run_verify,
    ),
    Command(
        "prune",
        "delete old checkpoints by a retention policy",
        commands.prune_arguments,
        commands.run_prune,
    ),
    Command(
        "gc",
        "remove what failed saves left behind (after a grace period)",
        commands.gc_arguments,
        commands.run_gc,
    ),
    Command("rm", "delete one checkpoint", commands.rm_arguments, commands.run_rm),
    Command(
        "doctor",
        "probe an endpoint and bucket: what works, and what s3ckpt will do there",
        commands.doctor_arguments,
        commands.run_doctor,
    ),
    Command(
        "memory",
        "list (or remove) the checkpoints this node's memory tier holds",
        memory_commands.memory_arguments,
        memory_commands.run_memory,
    ),
    Command(
        "cp",
        "copy a checkpoint to another prefix, bucket or endpoint (verified, committed last)",
        interop_commands.cp_arguments,
        interop_commands.run_cp,
    ),
    Command(
        "export",
        "write a checkpoint as safetensors shards or one torch.save file, for inference",
        interop_commands.export_arguments,
        interop_commands.run_export,
    ),
    Command(
        "import",
        "save a DCP folder, safetensors files or a torch.save file as a checkpoint",
        interop_commands.import_arguments,
        interop_commands.run_import,
    ),
)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (exit 2), like every other error; with
    ``json_errors`` set, also as the ``--json`` failure document on stdout."""

    json_errors = False

    def error(self, message: str) -> NoReturn:
        text = f"{message} (see {self.prog} --help)"
        if self.json_errors:
            print_failure(text, 2)
        self.exit(2, f"{self.prog}: error: {text}\n")


def build_parser(*, json_errors: bool = False) -> argparse.ArgumentParser:
    """The ``s3ckpt`` parser; ``json_errors``: usage errors also print the ``--json``
    failure document."""
    parser = _Parser(prog="s3ckpt", description="S3 checkpoint engine for PyTorch: tools.")
    parser.add_argument("--version", action="version", version=f"s3ckpt {__version__}")
    parser.json_errors = json_errors
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        sub_parser = sub.add_parser(command.name, help=command.help, description=command.help)
        sub_parser.json_errors = json_errors
        command.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=command.run)
    return parser


def print_failure(message: str, status: int) -> None:
    """The ``--json`` form of a failure, on stdout: ``{"error": message, "exit": status}``."""
    with contextlib.suppress(OSError):
        print(json.dumps({"error": message, "exit": status}), flush=True)


def wants_json(argv: Sequence[str]) -> bool:
    """Whether the command line asks for ``--json`` (as argparse reads it: before any
    ``--``, or an unambiguous abbreviation such as ``--js``), known before parsing so that
    a usage error is reported in JSON too."""
    for arg in argv:
        if arg == "--":
            return False
        if len(arg) >= 3 and "--json".startswith(arg):
            return True
    return False


class CommandTimeout(EndpointError):
    """The command ran past ``--timeout``."""


@contextlib.contextmanager
def _bounded(seconds: float | None) -> Iterator[CancelScope | None]:
    """Stop the command once ``seconds`` have passed: a timer cancels its requests on the
    I/O loop (:class:`~s3ckpt.s3.loop.CancelScope`), and the request the command waits
    for, or its next one, raises :class:`CommandTimeout`. No signal interrupts the main
    thread wherever it happens to be (holding a lock, in a ``finally`` block, drawing the
    progress bar): it carries on to its next request, and fails there."""
    if not seconds:
        yield None
        return
    from s3ckpt.s3.loop import CancelScope

    scope = CancelScope()
    timer = threading.Timer(seconds, _expire, (scope, seconds))
    timer.daemon = True
    with scope:
        timer.start()
        try:
            yield scope
        finally:
            timer.cancel()


def _expire(scope: CancelScope, seconds: float) -> None:
    """The timer's end (on the timer's thread)."""
    scope.cancel(
        CommandTimeout(
            f"gave up after {seconds:g} s (--timeout): the endpoint did not finish the command"
        )
    )


def _run(args: argparse.Namespace, scope: CancelScope | None) -> int:
    try:
        return int(args._run(args))
    except Exception as exc:
        # Past the timeout, whatever the command ended with (a cancelled wait inside DCP,
        # say) follows from it: report the timeout.
        if scope is not None and scope.error is not None and exc is not scope.error:
            raise scope.error from exc
        raise


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``s3ckpt`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = wants_json(argv)
    # --help, --version and usage errors raise SystemExit (0, 0, 2)
    args = build_parser(json_errors=as_json).parse_args(argv)
    prefix = f"s3ckpt {args.command}: error:"
    as_json = bool(getattr(args, "json", False))
    try:
        with _bounded(getattr(args, "timeout", None)) as scope:
            status = _run(args, scope)
            sys.stdout.flush()
            return status
    except (ConfigError, StorageError) as exc:
        return _failed(prefix, exc, 2, as_json)
    except S3CkptError as exc:
        return _failed(prefix, exc, 1, as_json)
    except BrokenPipeError:  # `s3ckpt ls ... | head`: the reader left; so do we, quietly
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:
        if as_json:
            print_failure("interrupted", 130)
        return 130
    except Exception as exc:  # a bug: its traceback follows, and Python exits 1
        if as_json:
            print_failure(f"internal error: {type(exc).__name__}: {exc}", 1)
        raise


def _failed(prefix: str, exc: BaseException, status: int, as_json: bool) -> int:
    print(f"{prefix} {exc}", file=sys.stderr)
    if as_json:
        print_failure(str(exc), status)
    return status
