"""The stall limit (``S3Config.stall_timeout_s``, :mod:`s3ckpt.s3.retry`) and the "store
full" answers (:mod:`s3ckpt.s3.error_mapping`) in isolation."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from botocore import exceptions as bce

from s3ckpt import S3Config
from s3ckpt.errors import (
    ConfigError,
    DeadlineExceededError,
    NotS3EndpointError,
    StorageError,
    StoreFullError,
    StoreStalledError,
    TransientStorageError,
)
from s3ckpt.s3 import retry
from s3ckpt.s3.error_mapping import translate, translate_final
from s3ckpt.s3.requests import Requests, Retrying
from tests.unit.s3.test_retry import tried

SILENT = bce.ReadTimeoutError(endpoint_url="http://x")


def _policy(**changes: object) -> retry.RetryPolicy:
    options: dict[str, object] = {"base_delay": 0.0, "stall_timeout": 60.0, "idle_timeout": 30.0}
    return retry.RetryPolicy(**{**options, **changes})  # type: ignore[arg-type]


async def _no_sleep(_: float) -> None:
    return None


def _run(failures: list[BaseException], policy: retry.RetryPolicy) -> retry.RetryError | str:
    """Run a request whose tries fail with ``failures`` in turn, then succeed."""

    async def attempt(number: int) -> str:
        if number <= len(failures):
            raise failures[number - 1]
        return "ok"

    try:
        return asyncio.run(tried(attempt, policy, sleep=_no_sleep))
    except retry.RetryError as exc:
        return exc


def test_the_idle_timeout_is_half_the_stall_limit_or_the_read_timeout_where_shorter():
    assert S3Config().stall_timeout_s == 60.0 and S3Config().idle_timeout() == 30.0
    assert S3Config(read_timeout=10).idle_timeout() == 10
    assert S3Config(stall_timeout_s=None).idle_timeout() == S3Config().read_timeout
    assert S3Config(stall_timeout_s=4).client_key() != S3Config().client_key()
    with pytest.raises(ConfigError, match="stall_timeout_s"):
        S3Config(stall_timeout_s=0)


def test_two_silent_tries_of_half_the_limit_end_the_request_as_stalled():
    stopped = _run([SILENT, SILENT, SILENT], _policy())
    assert isinstance(stopped, retry.RetryError)
    assert stopped.attempts == 2 and stopped.stalled == pytest.approx(60.0)


def test_one_silent_try_is_a_blip_retried_on_a_fresh_connection():
    assert _run([SILENT], _policy()) == "ok"


def test_anything_but_silence_between_silent_tries_starts_the_count_again():
    reset = ConnectionResetError()
    assert _run([SILENT, reset, SILENT, reset, SILENT], _policy()) == "ok"


def test_without_a_stall_limit_silent_tries_go_on_until_the_deadline_or_cap():
    assert _run([SILENT] * 5, _policy(stall_timeout=None)) == "ok"


def test_a_silent_try_while_the_whole_store_has_been_silent_for_the_limit_is_a_stall():
    answers = retry.StoreAnswers()
    answers.asking()
    answers.silent_since -= 61.0  # type: ignore[operator]  # asked 61 s ago, no answer
    stopped = _run([SILENT], _policy(answers=answers))
    assert isinstance(stopped, retry.RetryError) and stopped.stalled >= 60.0


def test_an_answer_ends_the_store_silence_and_is_what_a_stall_reports():
    answers = retry.StoreAnswers()
    assert "has not answered" in answers.describe()
    answers.asking()
    answers.done(silent=True)
    assert answers.silence() >= 0.0 and answers.silent_since is not None
    answers.note("UploadPart OK")
    assert answers.silence() == 0.0
    assert "last answer to this process was UploadPart OK" in answers.describe()
    answers.asking()
    answers.done(silent=False)  # a dropped connection, nothing else in flight
    assert answers.silent_since is None


def test_a_stall_is_worded_as_one_and_is_not_retried_again():
    error = translate_final(
        SILENT,
        2,
        out_of_time=False,
        operation="UploadPart",
        bucket="b",
        key="run/step-1/data.bin",
        stalled=60.0,
        last_answer="the store's last answer to this process was UploadPart OK, 62 s ago",
    )
    assert isinstance(error, StoreStalledError) and isinstance(error, TransientStorageError)
    assert not isinstance(error, DeadlineExceededError)
    text = str(error)
    assert "UploadPart s3://b/run/step-1/data.bin stalled" in text
    assert "60 s" in text and "stall_timeout_s" in text and "UploadPart OK, 62 s ago" in text
    assert (error.operation, error.bucket, error.key) == ("UploadPart", "b", "run/step-1/data.bin")
    assert not retry.is_retryable(error)


def _answer(code: str, status: int, message: str = "") -> bce.ClientError:
    error = {"Code": code, "Message": message} if code else {}
    headers = {"x-amz-request-id": "1", "content-type": "application/xml"}
    return bce.ClientError(
        {
            "Error": error or {"Code": str(status), "Message": ""},
            "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": headers},
        },
        "PutObject",
    )


@pytest.mark.parametrize(
    ("code", "status", "says"),
    [
        ("QuotaExceeded", 403, "over its quota"),
        ("InsufficientStorage", 507, "the store is full"),
        ("XMinioStorageFull", 507, "the store is full"),
        ("", 507, "the store is full"),  # a bare 507, no S3 error document
        ("EntityTooLarge", 400, "larger than the store accepts"),
    ],
)
def test_a_store_with_no_room_says_so(code, status, says):
    exc = _answer(code, status, "m")
    error = translate(exc, operation="PutObject", bucket="b", key="k")
    assert isinstance(error, StoreFullError) and isinstance(error, StorageError), repr(error)
    assert not isinstance(error, (NotS3EndpointError, TransientStorageError))
    assert says in str(error) and "s3://b/k" in str(error)
    assert not retry.is_retryable(exc)


def test_a_request_to_a_store_still_stalled_waits_a_short_while_at_most():
    """After a stall, and until the store answers anything, a request (the failed save's
    clean-up, its in-flight record) is cut short instead of waiting out its own limit."""
    requests = Requests(S3Config(stall_timeout_s=0.4), "b")  # idle timeout 0.2 s
    handle = SimpleNamespace(answers=retry.StoreAnswers(), answered=True)
    handle.answers.stalled = True

    async def request(seconds: float) -> str:
        counted = retry.Tries(retry.RetryPolicy())
        async with Retrying(requests, "HeadBucket", None, counted, handle) as tries:  # type: ignore[arg-type]
            while True:
                try:
                    return await asyncio.sleep(seconds, "done")
                except Exception as exc:
                    await tries.failed(exc)

    began = time.monotonic()
    with pytest.raises(StoreStalledError) as info:
        asyncio.run(request(30))
    assert 0.2 <= time.monotonic() - began < 30 and retry.is_stall(info.value.__cause__)
    assert "HeadBucket s3://b stalled" in str(info.value)
    handle.answers.note("HeadBucket OK")  # the store answers again: no more cutting short
    assert not handle.answers.stalled
    assert asyncio.run(request(0.3)) == "done"
