"""The retry policy in isolation: what is retried, how long it waits, when it stops."""

from __future__ import annotations

import asyncio
import random
import ssl
import time

import aiohttp
import pytest
from botocore import exceptions as bce

from s3ckpt.errors import (
    AccessDeniedError,
    DeadlineExceededError,
    EndpointError,
    TransientStorageError,
)
from s3ckpt.s3 import retry
from s3ckpt.s3.error_mapping import translate_final


def _client_error(code: str, status: int) -> bce.ClientError:
    return bce.ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )


@pytest.mark.parametrize(
    "exc",
    [
        _client_error("SlowDown", 503),
        _client_error("InternalError", 500),
        _client_error("RequestTimeout", 400),
        _client_error("BadDigest", 400),  # damaged in transit: sending again fixes it
        _client_error("", 502),
        bce.EndpointConnectionError(endpoint_url="http://x"),
        bce.ReadTimeoutError(endpoint_url="http://x"),
        bce.ConnectionClosedError(endpoint_url="http://x"),
        aiohttp.ClientPayloadError("payload not completed"),
        aiohttp.ServerDisconnectedError(),
        ConnectionResetError(),
        asyncio.TimeoutError(),
        retry.ShortReadError("ended early"),
        TransientStorageError("already translated"),
    ],
    ids=repr,
)
def test_transient_failures_are_retried(exc):
    assert retry.is_retryable(exc)


@pytest.mark.parametrize(
    "exc",
    [
        _client_error("AccessDenied", 403),
        _client_error("NoSuchKey", 404),
        _client_error("NoSuchBucket", 404),
        _client_error("InvalidRequest", 400),
        _client_error("PreconditionFailed", 412),
        bce.SSLError(endpoint_url="https://x", error=ssl.SSLCertVerificationError()),
        bce.NoCredentialsError(),
        EndpointError("translated TLS failure"),
        ValueError("a bug"),
    ],
    ids=repr,
)
def test_failures_a_retry_cannot_fix_are_not(exc):
    assert not retry.is_retryable(exc)


def test_full_jitter_stays_under_an_exponential_cap():
    policy = retry.RetryPolicy(base_delay=0.5, max_delay=3.0)
    rng = random.Random(1)
    for n, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 3.0), (10, 3.0)]:
        delays = [policy.delay(n, rng) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in delays)
        assert max(delays) > ceiling * 0.8  # jitter spreads over the whole interval


def test_the_backoff_base_is_the_configured_one():
    """``S3Config.retry_base_delay_s`` is the base of every request's backoff."""
    from s3ckpt.config import S3Config
    from s3ckpt.s3.requests import Requests

    def policy_of(config: S3Config) -> retry.RetryPolicy:
        return Requests(config, "b").retrying("PutObject", "k").tries.policy

    assert policy_of(S3Config()).base_delay == 0.25
    short = policy_of(S3Config(retry_base_delay_s=0.01))
    rng = random.Random(1)
    delays = [short.delay(n, rng) for n in (1, 2, 3) for _ in range(100)]
    assert all(0 <= d <= 0.04 for d in delays) and max(delays) > 0.03


async def tried(attempt, policy, sleep=asyncio.sleep, clock=time.monotonic, answered=None):
    """Send ``attempt(n)`` for n = 1, 2, ... as a request's owner does, asking its tries
    after each failure whether another try may go and after how long (``answered``:
    asked at each failure whether the endpoint has answered by then)."""
    tries = retry.Tries(policy, clock=clock)
    while True:
        try:
            return await attempt(tries.number)
        except Exception as exc:
            endpoint_answered = None if answered is None else answered()
            await sleep(tries.after(exc, endpoint_answered=endpoint_answered))


def _run(attempt, policy):
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    result = asyncio.run(tried(attempt, policy, sleep=sleep))
    return result, slept


def test_run_retries_until_success_and_passes_the_attempt_number():
    seen: list[int] = []

    async def attempt(number: int) -> str:
        seen.append(number)
        if number < 3:
            raise _client_error("SlowDown", 503)
        return "ok"

    result, slept = _run(attempt, retry.RetryPolicy(max_attempts=4))
    assert (result, seen, len(slept)) == ("ok", [1, 2, 3], 2)


def test_run_gives_up_after_max_attempts_with_the_last_error():
    async def attempt(number: int) -> None:
        raise _client_error("SlowDown", 503)

    with pytest.raises(retry.RetryError) as info:
        _run(attempt, retry.RetryPolicy(max_attempts=3))
    assert info.value.attempts == 3 and not info.value.out_of_time
    error = translate_final(
        info.value.last, 3, out_of_time=False, operation="PutObject", bucket="b", key="k"
    )
    assert type(error) is TransientStorageError and error.code == "SlowDown"
    assert "gave up after 3 attempts" in str(error) and "s3://b/k" in str(error)


def test_a_non_retryable_failure_is_raised_at_once():
    calls: list[int] = []

    async def attempt(number: int) -> None:
        calls.append(number)
        raise _client_error("AccessDenied", 403)

    with pytest.raises(bce.ClientError):
        _run(attempt, retry.RetryPolicy(max_attempts=5))
    assert calls == [1]
    error = translate_final(
        _client_error("AccessDenied", 403), 1, out_of_time=False, operation="GetObject"
    )
    assert isinstance(error, AccessDeniedError)


def test_the_deadline_ends_retrying_before_max_attempts():
    calls: list[int] = []

    async def attempt(number: int) -> None:
        calls.append(number)
        raise bce.ReadTimeoutError(endpoint_url="http://x")

    policy = retry.RetryPolicy(max_attempts=100, base_delay=1.0, deadline=time.monotonic() + 0.5)
    with pytest.raises(retry.RetryError) as info:
        asyncio.run(tried(attempt, policy))
    assert info.value.out_of_time and len(calls) < 100
    error = translate_final(
        info.value.last, len(calls), out_of_time=True, operation="UploadPart", bucket="b", key="k"
    )
    assert isinstance(error, DeadlineExceededError) and isinstance(error, TransientStorageError)
    assert "deadline_s" in str(error) and "timed out" in str(error)


def test_every_phase_of_a_save_shares_one_deadline(monkeypatch):
    """The retry budget starts once per save (``set_up_storage_writer``) and once per load
    (``read_metadata``), not once per request phase."""
    from s3ckpt import S3StorageReader, S3StorageWriter
    from s3ckpt.dcp import location

    now = [1000.0]
    monkeypatch.setattr(location.time, "monotonic", lambda: now[0])
    writer = S3StorageWriter(
        "s3://bucket/run/step-1", endpoint_url="http://127.0.0.1:9", deadline_s=60
    )
    writer.set_up_storage_writer(True, rank=0)
    first = writer._store().deadline
    now[0] += 45  # the uploads took a while
    assert writer._store().deadline == first == 1060.0
    writer.set_up_storage_writer(True, rank=0)  # the next save gets a budget of its own
    assert writer._store().deadline == 1105.0

    reader = S3StorageReader(
        "s3://bucket/run/step-1", endpoint_url="http://127.0.0.1:9", deadline_s=30
    )
    reader._start_budget()
    now[0] += 20
    assert reader._store().deadline == 1075.0


class _FakeTime:
    """A clock that moves only when the retry loop sleeps."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    async def sleep(self, seconds: float) -> None:
        self.now += seconds

    def clock(self) -> float:
        return self.now

    def run(self, attempt, policy, answered=None):
        return asyncio.run(tried(attempt, policy, self.sleep, self.clock, answered))


def test_transient_failures_are_retried_until_the_deadline_not_a_count():
    """Twenty failures in a row of one request, well inside the deadline, still succeed
    (a count of four tries made large saves fail), and every retry is counted."""
    time_ = _FakeTime()
    calls: list[int] = []

    async def attempt(number: int) -> str:
        calls.append(number)
        if number <= 20:
            raise _client_error("SlowDown", 503)
        return "ok"

    tally = retry.Tally()
    policy = retry.RetryPolicy(deadline=900.0, tally=tally)
    result = time_.run(attempt, policy)
    assert result == "ok" and len(calls) == 21 and tally.retries == 20
    assert 0 < time_.now < 900.0


def test_with_neither_deadline_nor_cap_a_request_still_stops():
    async def attempt(number: int) -> None:
        raise _client_error("SlowDown", 503)

    with pytest.raises(retry.RetryError) as info:
        _run(attempt, retry.RetryPolicy())
    assert info.value.attempts == retry.ATTEMPTS_WITHOUT_DEADLINE


def test_the_deadline_is_read_from_the_injected_clock():
    time_ = _FakeTime(100.0)

    async def attempt(number: int) -> None:
        raise bce.ReadTimeoutError(endpoint_url="http://x")

    policy = retry.RetryPolicy(base_delay=1.0, max_delay=1.0, deadline=110.0)
    with pytest.raises(retry.RetryError) as info:
        time_.run(attempt, policy)
    assert info.value.out_of_time and time_.now < 110.0


@pytest.mark.parametrize(
    "answered, tries", [(False, retry.UNANSWERED_ENDPOINT_ATTEMPTS), (True, 30)]
)
def test_a_refused_connection_fails_fast_only_before_the_endpoint_ever_answered(answered, tries):
    """A wrong endpoint fails in a few tries; one that has answered before and now
    refuses (a restart, a failover) is retried like any blip, until the deadline."""
    time_ = _FakeTime()
    calls: list[int] = []

    async def attempt(number: int) -> str:
        calls.append(number)
        if number < 30:
            raise bce.EndpointConnectionError(endpoint_url="http://x")
        return "ok"

    policy = retry.RetryPolicy(deadline=10_000.0, endpoint_answered=answered)
    if answered:
        assert time_.run(attempt, policy) == "ok"
    else:
        with pytest.raises(retry.RetryError):
            time_.run(attempt, policy)
    assert len(calls) == tries


def test_a_request_begun_before_any_answer_is_retried_as_a_blip_once_another_answers():
    """Several saves start at once on a new client: one request's refusals count against
    the few tries of an unanswered endpoint only until another request is answered."""
    time_ = _FakeTime()
    answered = {"yet": False}
    calls: list[int] = []

    async def attempt(number: int) -> str:
        calls.append(number)
        if number == retry.UNANSWERED_ENDPOINT_ATTEMPTS - 1:
            answered["yet"] = True  # meanwhile, a request beside this one was answered
        if number < 12:
            raise bce.EndpointConnectionError(endpoint_url="http://x")
        return "ok"

    policy = retry.RetryPolicy(deadline=10_000.0, endpoint_answered=False)
    assert time_.run(attempt, policy, answered=lambda: answered["yet"]) == "ok"
    assert len(calls) == 12
