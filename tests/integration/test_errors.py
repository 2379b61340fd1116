"""Each way of pointing s3ckpt at the wrong thing gives one clear error, fast."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3_servers import held_port

from s3ckpt import (
    AccessDeniedError,
    BucketNotFoundError,
    CheckpointNotFoundError,
    EndpointError,
    InvalidURIError,
    S3CkptError,
    S3StorageReader,
    S3StorageWriter,
    unwrap,
)


def _save_error(writer) -> BaseException:
    with pytest.raises(BaseException) as info:
        dcp.save({"a": torch.ones(3)}, storage_writer=writer)
    return unwrap(info.value)


def test_an_unreachable_endpoint_fails_within_seconds(s3_options):
    with held_port() as port:
        options = {**s3_options, "endpoint_url": f"http://127.0.0.1:{port}"}
        started = time.monotonic()
        error = _save_error(S3StorageWriter("s3://s3ckpt/run/step-1", **options))
        assert isinstance(error, EndpointError)
        assert "could not connect" in str(error)
        with pytest.raises(EndpointError):
            S3StorageReader("s3://s3ckpt/run/step-1", **options).read_metadata()
        assert time.monotonic() - started < 30


def test_wrong_credentials_are_access_denied_and_never_echoed(s3_prefix, s3_options):
    options = {
        **s3_options,
        "access_key_id": "AKIAWRONGWRONG",
        "secret_access_key": "wrong-secret-123456",
    }
    error = _save_error(S3StorageWriter(s3_prefix, **options))
    assert isinstance(error, AccessDeniedError)
    with pytest.raises(AccessDeniedError) as info:
        S3StorageReader(s3_prefix, **options).read_metadata()
    for text in (str(error), repr(error), str(info.value)):
        assert "wrong-secret-123456" not in text
        assert s3_options["secret_access_key"] not in text


def test_a_missing_bucket_is_named(s3_options):
    error = _save_error(S3StorageWriter("s3://no-such-bucket-s3ckpt/run/step-1", **s3_options))
    assert isinstance(error, BucketNotFoundError)
    with pytest.raises(BucketNotFoundError):
        S3StorageReader("s3://no-such-bucket-s3ckpt/run/step-1", **s3_options).read_metadata()


def test_a_checkpoint_that_does_not_exist(s3_prefix, s3_options):
    reader = S3StorageReader(s3_prefix, **s3_options)
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        reader.read_metadata()
    with pytest.raises(BaseException, match="no committed checkpoint") as info:
        dcp.load({"a": torch.zeros(3)}, storage_reader=reader)
    assert isinstance(unwrap(info.value), CheckpointNotFoundError)  # not DCP's AssertionError


@pytest.mark.parametrize("uri", ["/tmp/ckpt", "file:///tmp/x", "s3://bucket-only", "s3:/typo/x"])
def test_non_s3_uris_are_refused_before_any_io(uri, s3_options):
    with pytest.raises(InvalidURIError):
        S3StorageWriter(uri, **s3_options)
    with pytest.raises(InvalidURIError):
        dcp.save(
            {"a": torch.ones(1)}, checkpoint_id=uri, storage_writer=S3StorageWriter(**s3_options)
        )
    with pytest.raises(InvalidURIError):
        S3StorageReader(uri, **s3_options)


def test_every_error_derives_from_one_base(s3_options):
    with pytest.raises(S3CkptError):
        S3StorageReader("s3://s3ckpt/does/not/exist", **s3_options).read_metadata()


def test_the_cli_reports_refused_credentials_in_one_line_without_the_secret(
    local_s3, s3_prefix, tmp_path
):
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        **local_s3.env(),
        "AWS_SECRET_ACCESS_KEY": "wrong-secret-123456",
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }
    denied = subprocess.run(
        [sys.executable, "-m", "s3ckpt", "ls", s3_prefix],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert denied.returncode == 2 and denied.stdout == ""
    assert denied.stderr.startswith("s3ckpt ls: error: access denied"), denied.stderr
    assert "check the credentials" in denied.stderr and denied.stderr.count("\n") == 1
    assert "wrong-secret-123456" not in denied.stderr
