"""The retry policy: which failures are worth another try, how long to wait, when to stop.

s3ckpt has exactly one retry layer, this one (botocore's own retries are switched off in
:mod:`s3ckpt.s3.client`), because only the store knows what a request means: a ranged GET
resumes from the first byte it has not delivered, a create whose response was lost is
recognised as our own write. Three bounds keep a failing save from hanging:

* ``max_attempts`` tries per request;
* exponential backoff with full jitter (a random wait up to ``base * 2**retry``, capped),
  so that many parts throttled at once do not come back in lockstep;
* a deadline (``time.monotonic()``) shared by every request of one save or load: once it
  has passed, failures are no longer retried. It never cuts a request that is working.

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


@dataclass(frozen=True)
class RetryPolicy:
    """How many tries, how long between them, and until when (``None``: no deadline)."""

    max_attempts: int = 4
    base_delay: float = 0.25
    max_delay: float = 20.0
    deadline: float | None = None

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
            if number >= policy.max_attempts:
                raise RetryError(exc, number, out_of_time=False) from exc
            delay = policy.delay(number)
            if policy.deadline is not None and time.monotonic() + delay >= policy.deadline:
                raise RetryError(exc, number, out_of_time=True) from exc
            log.info(
                "%s failed (%s); retry %d of %d in %.2fs",
                what,
                type(exc).__name__,
                number,
                policy.max_attempts - 1,
                delay,
            )
            await sleep(delay)
            number += 1
