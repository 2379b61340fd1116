"""The retry policy: which failures are worth another try, how long to wait, when to stop.

s3ckpt has exactly one retry layer, this one (botocore's own retries are switched off in
:mod:`s3ckpt.s3.client`), because only the store knows what a request means: a ranged GET
resumes from the first byte it has not delivered, a create whose response was lost is
recognised as our own write. Three bounds keep a failing save from hanging:

* a deadline (``time.monotonic()``) shared by every request of one save or load: a
  transient failure is retried until it has passed, then no more. It never cuts a request
  that is working. A count of tries per request makes large saves fragile (with 5 %
  throttling and about 1,000 requests per rank, a 1,000-rank save meets four failures in a
  row on some request with probability about 0.998), so by default there is none;
* ``max_attempts``, a cap on tries per request only where one is asked for (the CLI's
  short commands), or where there is no deadline (:data:`ATTEMPTS_WITHOUT_DEADLINE`);
* exponential backoff with full jitter (a random wait up to ``base * 2**retry``, capped),
  so that many parts throttled at once do not come back in lockstep;
* an endpoint that has not answered one request of this process yet and refuses the
  connection (or lets it time out) is given :data:`UNANSWERED_ENDPOINT_ATTEMPTS` tries, a
  few seconds: a wrong endpoint fails in seconds rather than at the deadline. Once it has
  answered, a refused connection is a blip (a restart, a failover) like any other.

Only failures that a retry can fix are retried: throttling, 5xx, ``RequestTimeout``,
``BadDigest`` (bytes damaged in transit), dropped and reset connections, timeouts
(a stalled connection hits the read timeout) and short responses. Anything else — a
403, a missing key or bucket, a failed precondition, a TLS verification failure — is
raised at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
from botocore import exceptions as bce

from s3ckpt.errors import S3CkptError, TransientStorageError

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "BadDigest",
        "IncompleteBody",
    }
)
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


class ShortReadError(Exception):
    """A response ended before the bytes it announced (a connection closed early)."""


ATTEMPTS_WITHOUT_DEADLINE = 10
UNANSWERED_ENDPOINT_ATTEMPTS = 4
# Failures to open a connection at all (nothing was sent).
_CONNECT_FAILURES = (
    bce.EndpointConnectionError,
    bce.ConnectTimeoutError,
    aiohttp.ClientConnectorError,
    ConnectionRefusedError,
)


@dataclass
class Tally:
    """Retries counted over every request of one save or load (its metrics)."""

    retries: int = 0


@dataclass(frozen=True)
class RetryPolicy:
    """Until when to retry (``None``: no deadline), how many tries at most (``None``: as
    many as the deadline allows), how long between them, and where to count retries."""

    max_attempts: int | None = None
    base_delay: float = 0.25
    max_delay: float = 20.0
    deadline: float | None = None
    tally: Tally | None = None
    # Whether the endpoint has answered a request of this process: a flag, or a callable
    # asked at each failure, so that a request that started before any answer came is
    # retried as a blip once another request has had one.
    endpoint_answered: bool | Callable[[], bool] = True

    def attempt_limit(self, failure: BaseException) -> int | None:
        """The most tries of a request that just failed with ``failure``."""
        limit = self.max_attempts
        if limit is None and self.deadline is None:
            limit = ATTEMPTS_WITHOUT_DEADLINE
        answered = self.endpoint_answered
        if callable(answered):
            answered = answered()
        if not answered and isinstance(failure, _CONNECT_FAILURES):
            limit = min(limit or UNANSWERED_ENDPOINT_ATTEMPTS, UNANSWERED_ENDPOINT_ATTEMPTS)
        return limit

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """Full jitter: uniform in ``[0, min(max_delay, base_delay * 2**(retry - 1))]``."""
        ceiling = min(self.max_delay, self.base_delay * 2 ** (retry - 1))
        return (rng or random).uniform(0.0, ceiling)


class RetryError(Exception):
    """Raised by :func:`run` when it stops retrying; ``last`` is the final failure."""

    def __init__(self, last: BaseException, attempts: int, *, out_of_time: bool) -> None:
        super().__init__(f"gave up after {attempts} attempt(s): {last!r}")
        self.last = last
        self.attempts = attempts
        self.out_of_time = out_of_time


def is_retryable(exc: BaseException) -> bool:
    """Whether another try of the same request can succeed (see the module docstring)."""
    if isinstance(exc, bce.ClientError):
        return _retryable_response(exc)
    if isinstance(exc, S3CkptError):  # already translated: its class says it all
        return isinstance(exc, TransientStorageError)
    if isinstance(exc, (bce.SSLError, aiohttp.ClientSSLError)):
        return False  # a certificate does not become valid by asking again
    if isinstance(exc, ShortReadError):
        return True
    return isinstance(
        exc,
        bce.ConnectionError  # EndpointConnectionError, timeouts, ConnectionClosedError
        | bce.HTTPClientError
        | bce.ResponseStreamingError
        | bce.IncompleteReadError
        | aiohttp.ClientConnectionError
        | aiohttp.ClientPayloadError
        | asyncio.TimeoutError
        | TimeoutError
        | ConnectionError,
    )


def _retryable_response(exc: bce.ClientError) -> bool:
    error = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return error.get("Code") in RETRYABLE_CODES or status in RETRYABLE_STATUS


async def run(
    attempt: Callable[[int], Awaitable[T]],
    policy: RetryPolicy,
    *,
    what: str = "request",
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Call ``attempt(n)`` for n = 1, 2, ... until it returns, fails for good, or time is up.

    Non-retryable failures propagate unchanged; when retrying stops, :class:`RetryError`
    carries the last failure. ``n`` lets an attempt know it may be repeating a request
    whose response was lost.
    """
    number = 1
    while True:
        try:
            return await attempt(number)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not is_retryable(exc):
                raise
            limit = policy.attempt_limit(exc)
            if limit is not None and number >= limit:
                raise RetryError(exc, number, out_of_time=False) from exc
            delay = policy.delay(number)
            if policy.deadline is not None and clock() + delay >= policy.deadline:
                raise RetryError(exc, number, out_of_time=True) from exc
            log.info(
                "%s failed (%s); retry %d%s in %.2fs",
                what,
                type(exc).__name__,
                number,
                f" of {limit - 1}" if limit is not None else "",
                delay,
            )
            if policy.tally is not None:
                policy.tally.retries += 1
            await sleep(delay)
            number += 1
