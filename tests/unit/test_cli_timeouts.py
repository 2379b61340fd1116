"""A silent endpoint (accepts connections, never answers) fails a CLI command quickly,
with one line on stderr."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from s3ckpt.cli import commands
from s3ckpt.cli.main import main
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
