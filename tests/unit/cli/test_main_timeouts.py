"""A silent endpoint (accepts connections, never answers) fails a CLI command quickly,
with one line on stderr; ``--timeout`` stops a command at its requests, never in the middle
of whatever the main thread was running."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from s3ckpt.cli import commands
from s3ckpt.cli import main as cli_main
from s3ckpt.cli.main import main
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.retry import RetryPolicy


@pytest.fixture
def silent_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for name, value in (("AWS_ACCESS_KEY_ID", "AKIDSILENT"), ("AWS_SECRET_ACCESS_KEY", "s"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):  # fmt: skip
        monkeypatch.setenv(name, value)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])  # and never answer
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for sock in accepted:
        sock.close()
    listener.close()


def test_the_default_request_timeouts_bound_a_command_under_a_minute() -> None:
    backoff = sum(RetryPolicy().base_delay * 2**n for n in range(commands.ATTEMPTS - 1))
    worst = commands.ATTEMPTS * commands.READ_TIMEOUT_S + backoff + commands.CONNECT_TIMEOUT_S
    assert worst < 60


def test_a_silent_endpoint_fails_ls_after_the_read_timeouts(silent_endpoint, capsys) -> None:
    started = time.monotonic()
    code = main(
        ["ls", "s3://bucket/run", "--endpoint-url", silent_endpoint, "--read-timeout", "0.5s"]
    )
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    # Ignoring --read-timeout, one request alone would wait the default read timeout; the
    # bound is that, not what the command takes (a few seconds), so load cannot break it.
    assert code == 2 and elapsed < commands.READ_TIMEOUT_S
    assert err.count("\n") == 1 and err.startswith("s3ckpt ls: error:") and "timed out" in err


def test_timeout_bounds_the_whole_command(silent_endpoint, capsys) -> None:
    started = time.monotonic()
    code = main(["ls", "s3://bucket/run", "--endpoint-url", silent_endpoint, "--timeout", "1s"])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 2 and elapsed < commands.READ_TIMEOUT_S  # what waiting for a request costs
    assert err.count("\n") == 1 and "gave up after 1 s (--timeout)" in err


@pytest.fixture
def command(monkeypatch: pytest.MonkeyPatch):
    """Make ``s3ckpt ls`` run the given function; returns an event set once the
    ``--timeout`` timer has fired."""
    fired = threading.Event()
    expire = cli_main._expire

    def expire_and_tell(scope, seconds) -> None:
        expire(scope, seconds)
        fired.set()

    monkeypatch.setattr(cli_main, "_expire", expire_and_tell)

    def install(run) -> threading.Event:
        fake = cli_main.Command("ls", "list", commands.ls_arguments, run)
        monkeypatch.setattr(cli_main, "COMMANDS", (fake,))
        return fired

    return install


def test_timeout_lets_a_finally_block_holding_a_lock_finish(command, capsys) -> None:
    lock, done = threading.Lock(), []

    def run(args) -> int:
        try:
            io_loop().run(asyncio.sleep(0))
        finally:
            with lock:
                assert fired.wait(60)  # the timeout fires here: nothing is raised into us
                done.append("cleaned up")
        io_loop().run(asyncio.sleep(60))  # the next request ends at once, with the timeout
        done.append("went on")
        return 0

    fired = command(run)
    code = main(["ls", "s3://bucket/run", "--timeout", "0.1s"])
    err = capsys.readouterr().err
    assert code == 2 and done == ["cleaned up"] and not lock.locked()
    assert err.count("\n") == 1 and err.startswith("s3ckpt ls: error:")
    assert "gave up after 0.1 s (--timeout)" in err


def test_timeout_cancels_the_request_on_the_loop_before_the_command_ends(command, capsys):
    stopped = threading.Event()

    async def request() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            stopped.set()  # the request's clean-up, on the loop

    def run(args) -> int:
        io_loop().run(request())
        return 0

    command(run)
    code = main(["ls", "s3://bucket/run", "--timeout", "0.1s"])
    err = capsys.readouterr().err
    assert code == 2 and stopped.is_set()  # cancelled, and its cancellation awaited
    assert err.count("\n") == 1 and "gave up after 0.1 s (--timeout)" in err


def test_a_command_done_before_its_timeout_is_untouched(command, capsys) -> None:
    fired = command(lambda args: io_loop().run(asyncio.sleep(0, result=0)))
    assert main(["ls", "s3://bucket/run", "--timeout", "1h"]) == 0
    assert capsys.readouterr().err == "" and not fired.is_set()
