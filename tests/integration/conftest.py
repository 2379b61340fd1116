"""Fixtures for tests that talk to the embedded SeaweedFS server."""

from __future__ import annotations

import copy
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _cli_runner
import pytest
from _dist_worker import server_options

from s3ckpt import S3StorageReader, S3StorageWriter
from s3ckpt.config import S3URI, make_config
from s3ckpt.s3.store import ObjectStore
from s3ckpt.testing.local_s3 import LocalS3Server


@pytest.fixture
def s3_options(local_s3: LocalS3Server) -> dict[str, Any]:
    """Keyword options that point a writer or reader at the local server."""
    return server_options(local_s3)


@pytest.fixture
def make_writer(s3_options: dict[str, Any]):
    def make(uri: str | None = None, **options: Any) -> S3StorageWriter:
        return S3StorageWriter(uri, **{**s3_options, **options})

    return make


@pytest.fixture
def make_reader(s3_options: dict[str, Any]):
    def make(uri: str | None = None, **options: Any) -> S3StorageReader:
        return S3StorageReader(uri, **{**s3_options, **options})

    return make


@pytest.fixture
def list_keys(local_s3: LocalS3Server):
    """All keys under a checkpoint URI, relative to it."""

    def keys(uri: str) -> list[str]:
        location = S3URI.parse(uri)
        client = local_s3.client()
        paginator = client.get_paginator("list_objects_v2")
        found = []
        for page in paginator.paginate(Bucket=location.bucket, Prefix=location.prefix + "/"):
            found += [item["Key"][len(location.prefix) + 1 :] for item in page.get("Contents", [])]
        return sorted(found)

    return keys


@pytest.fixture
def pending_uploads(local_s3: LocalS3Server):
    """Multipart uploads still open under a checkpoint URI."""

    def uploads(uri: str) -> list[str]:
        location = S3URI.parse(uri)
        response = local_s3.client().list_multipart_uploads(
            Bucket=location.bucket, Prefix=location.prefix + "/"
        )
        return [u["Key"] for u in response.get("Uploads", [])]

    return uploads


@pytest.fixture
def retries(caplog: pytest.LogCaptureFixture):
    """The retries of S3 requests logged so far in the test (``s3ckpt.s3.retry``, one line
    a retry): what shows that a failure was, or was not, tried again."""
    caplog.set_level(logging.INFO, logger="s3ckpt.s3.retry")

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "s3ckpt.s3.retry"]

    return logged


@pytest.fixture
def fsspec_defaults() -> Iterator[None]:
    """fsspec's s3 defaults as they were: the Lightning integrations set them process-wide."""
    import fsspec.config

    saved = copy.deepcopy(fsspec.config.conf.get("s3"))
    yield
    if saved is None:
        fsspec.config.conf.pop("s3", None)
    else:
        fsspec.config.conf["s3"] = saved


@pytest.fixture
def cli(local_s3, monkeypatch, capsys, tmp_path):
    """The ``s3ckpt`` command, run in this process against the local server
    (:func:`_cli_runner.runner`); ``test_cli.py`` has one of its own."""
    return _cli_runner.runner(local_s3, monkeypatch, capsys, tmp_path)


@pytest.fixture(scope="module")
def forked_commands() -> Iterator[_cli_runner.ForkedCommands]:
    """``python -m s3ckpt`` commands, each a child process, forked from one process per test
    module that imported the command line once (:class:`_cli_runner.ForkedCommands`)."""
    with _cli_runner.ForkedCommands() as commands:
        yield commands


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """A fresh folder in /dev/shm (a node's shared memory, for the memory tier), removed
    afterwards."""
    root = Path(tempfile.mkdtemp(prefix="s3ckpt-test-", dir="/dev/shm"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def store(s3_options, local_s3) -> ObjectStore:
    """An ``ObjectStore`` on the local server's bucket."""
    return ObjectStore(make_config(None, **s3_options), local_s3.bucket)
