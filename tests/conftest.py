"""Shared fixtures: private S3 servers per test session, and a unique prefix per test.

Two real S3 implementations run: SeaweedFS (``seaweedfs_s3``, the default behind
``local_s3``) and moto's server (``moto_s3``). A module runs its tests against both with
``s3_servers.ON_BOTH``.

The tiers: a test that uses a server fixture is marked ``server``; one that starts a child
process is marked ``subprocess`` by hand. Every other test under ``tests/unit`` is marked
``fast``: ``make test-fast`` runs those (``pytest tests/unit -m fast``). A ``fast`` test
that starts a process (a subprocess, a fork, multiprocessing, so also a server) fails,
even where the code under test swallowed the refusal, so a test that needs the mark
cannot go without it.
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import re
import secrets
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
from s3_servers import MotoS3Server

from s3ckpt.testing.local_s3 import LocalS3Server

UNIT_TESTS = Path(__file__).parent / "unit"
INTEGRATION_TESTS = Path(__file__).parent / "integration"
# Fixtures that start an S3 server (tls_s3: tests/integration/test_tls.py). A test using
# one, directly or through another fixture, is marked ``server``.
SERVER_FIXTURES = frozenset({"seaweedfs_s3", "moto_s3", "local_s3", "tls_s3"})
# Every way a test process starts another: audit events for subprocess, fork and
# os.system; multiprocessing's spawn and forkserver call fork_exec, which raises none.
_SPAWN_EVENTS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system"}
)
_refusing: list[list[str]] = []  # while a fast test sets up or runs: what it tried to start


class ProcessRefusedError(RuntimeError):
    """Raised where a ``fast`` test starts a process."""


def _refuse(what: str) -> None:
    if _refusing:
        _refusing[-1].append(what)
        raise ProcessRefusedError(f"a fast-tier test started a process ({what})")


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in _SPAWN_EVENTS:
        _refuse(event)


sys.addaudithook(_audit)  # for good: hooks cannot be removed, and it costs a set lookup


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(INTEGRATION_TESTS):
            item.add_marker(pytest.mark.integration)
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)
        slow = item.get_closest_marker("server") or item.get_closest_marker("subprocess")
        if item.path.is_relative_to(UNIT_TESTS) and slow is None:
            item.add_marker(pytest.mark.fast)


@contextlib.contextmanager
def _no_processes(item: pytest.Item) -> Iterator[None]:
    """While a ``fast`` test sets up and runs: no process starts, and trying fails it."""
    if item.get_closest_marker("fast") is None:
        yield
        return
    tried: list[str] = []
    fork_exec = _posixsubprocess.fork_exec

    def refused_fork_exec(*args: Any, **kwargs: Any) -> Any:
        _refuse("_posixsubprocess.fork_exec")
        return fork_exec(*args, **kwargs)

    _refusing.append(tried)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_posixsubprocess, "fork_exec", refused_fork_exec)
            yield
    except BaseException:
        if tried:  # the refusal, or what the code under test made of it
            pytest.fail(_refusal(item, tried), pytrace=False)
        raise
    finally:
        _refusing.remove(tried)
    if tried:  # refused, and the code under test went on without the process
        pytest.fail(_refusal(item, tried), pytrace=False)


def _refusal(item: pytest.Item, tried: list[str]) -> str:
    return (
        f"{item.nodeid} is in the fast tier (tests/unit, `make test-fast`), which starts no "
        f"process, but it called {', '.join(sorted(set(tried)))}: mark it "
        "@pytest.mark.subprocess (or give it a server fixture) to leave the fast tier"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    with _no_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    with _no_processes(item):
        return (yield)


@pytest.fixture(scope="session")
def seaweedfs_s3() -> Iterator[LocalS3Server]:
    """A started SeaweedFS server (bucket ``s3ckpt``), stopped at the end of the session.

    Session-scoped because starting one costs about a second; tests keep out of each
    other's way through :func:`s3_prefix`, not through separate servers.
    """
    with LocalS3Server() as server:
        yield server


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3Server]:
    """moto's S3 server (bucket ``s3ckpt``), started on first use."""
    with MotoS3Server() as server:
        yield server


@pytest.fixture
def local_s3(request: pytest.FixtureRequest) -> Any:
    """The S3 server of this test: SeaweedFS unless parametrized (``s3_servers.ON_BOTH``)."""
    return request.getfixturevalue(getattr(request, "param", "seaweedfs_s3"))


@pytest.fixture
def s3_prefix(local_s3: Any, request: pytest.FixtureRequest) -> str:
    """``s3://<bucket>/<test-name>-<random>``: a location no other test (or rerun) uses."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name).strip("-")[:80]
    return f"s3://{local_s3.bucket}/{name}-{secrets.token_hex(4)}"
