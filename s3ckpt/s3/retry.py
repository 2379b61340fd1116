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
* a stall limit (``S3Config.stall_timeout_s``): a try that moves no byte for the
  client's idle timeout (``S3Config.idle_timeout``: half the limit, or ``read_timeout``
  where shorter) is stopped and tried again on a fresh connection (one connection
  silently dropped is a blip); once consecutive stopped tries of one request add up to
  the limit, the request stops with :class:`RetryError` ``stalled``, which
  :mod:`s3ckpt.s3.error_mapping` words as a stalled store. A store that filled up
  may hang instead of answering: its saves then fail in about the limit instead of at the
  deadline. The limit is also reached when a try was stopped for silence and the whole
  store has answered nothing to this process for that long while asked
  (:class:`StoreAnswers`). Only silence counts (each stopped try was silent for the
  whole idle timeout), so a slow link that keeps moving bytes never trips it. Any other
  failure, an answer included, starts the count again. Once a request has stalled, the
  requests that follow while the store still answers nothing (the failed save's
  clean-up) wait :data:`STILL_STALLED_S` at most.

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
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from botocore import exceptions as bce

from s3ckpt.errors import S3CkptError, StoreStalledError, TransientStorageError

log = logging.getLogger(__name__)

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
# How long a request may wait, at most, on a store that stalled a request of this process
# and has answered nothing since (a failed save's clean-up, its in-flight record): it is
# still stalled most likely, and the error it ends with should not wait for it once more.
STILL_STALLED_S = 10.0
UNANSWERED_ENDPOINT_ATTEMPTS = 4
# Failures to open a connection at all (nothing was sent).
_CONNECT_FAILURES = (
    bce.EndpointConnectionError,
    bce.ConnectTimeoutError,
    aiohttp.ClientConnectorError,
    ConnectionRefusedError,
)


# A try stopped because its connection moved no byte for the idle timeout: every route
# reports it as botocore's ReadTimeoutError (the data plane's timers, the native sender's
# socket timeouts, aiobotocore); a body read from aiohttp's stream, as aiohttp's own.
_SILENT_TRIES = (bce.ReadTimeoutError, aiohttp.SocketTimeoutError)


def is_stall(exc: BaseException) -> bool:
    """Whether a try ended because its connection went silent (no byte either way for
    the idle timeout), rather than with an answer or a dropped connection."""
    return isinstance(exc, _SILENT_TRIES)


class StoreAnswers:
    """When the store last answered this process (any request, any route), and since
    when it has been silent while asked (its tries ending in silence, or still in
    flight): how long the whole store has been silent, which a stalled request's error
    reports and which ends its retries sooner (:meth:`RetryPolicy.stalled`). One per
    client."""

    def __init__(self) -> None:
        self.last_at: float | None = None
        self.last = ""
        self.waiting = 0  # tries in flight
        self.silent_since: float | None = None  # None: not asked since its last answer
        self.stalled = False  # a request stalled, and the store has not answered since

    def asking(self) -> None:
        """A try goes to the store."""
        if self.silent_since is None:
            self.silent_since = time.monotonic()
        self.waiting += 1

    def done(self, *, silent: bool) -> None:
        """A try ended; ``silent``: stopped for silence (or cancelled: nothing was
        heard). One that failed otherwise (a dropped connection) with nothing else in
        flight ends the silence too."""
        self.waiting -= 1
        if not silent and self.waiting == 0:
            self.silent_since = None

    def note(self, what: str) -> None:
        """The store answered (``what``: the operation and its outcome)."""
        self.last_at, self.last = time.monotonic(), what
        self.silent_since = None
        self.stalled = False

    def silence(self) -> float:
        """Seconds the store has been asked without answering anything."""
        since = self.silent_since
        return 0.0 if since is None else time.monotonic() - since

    def describe(self) -> str:
        if self.last_at is None:
            return "the store has not answered any request of this process"
        ago = time.monotonic() - self.last_at
        return f"the store's last answer to this process was {self.last}, {ago:.0f} s ago"


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
    # Whether the endpoint has answered a request of this process (where the loop asking
    # :meth:`Tries.after` does not say it at each failure).
    endpoint_answered: bool = True
    # The stall limit (S3Config.stall_timeout_s; None: none) and how long each stopped
    # try was silent (S3Config.idle_timeout()).
    stall_timeout: float | None = None
    idle_timeout: float = 0.0
    answers: StoreAnswers | None = None

    def stalled(self, silent_tries: int) -> float | None:
        """The seconds of silence that make a request stalled after ``silent_tries``
        consecutive tries each silent for the idle timeout, or None where it is not:
        those tries add up to the stall limit, or the last one was silent and the whole
        store has answered nothing for the limit (tries of other requests stalled too:
        batches of parts that went silent one after another on each connection)."""
        limit = self.stall_timeout
        if limit is None or self.idle_timeout <= 0 or silent_tries < 1:
            return None
        silence = silent_tries * self.idle_timeout
        if self.answers is not None:
            silence = max(silence, self.answers.silence())
        # A tolerance for the float sum: two tries of half the limit make the limit.
        return silence if silence >= limit * (1 - 1e-9) else None

    def attempt_limit(
        self, failure: BaseException, *, endpoint_answered: bool | None = None
    ) -> int | None:
        """The most tries of a request that just failed with ``failure``;
        ``endpoint_answered``: whether the endpoint has answered a request of this process
        by now (a request that started before any answer came is retried as a blip once
        another request has had one), :attr:`endpoint_answered` where not given."""
        limit = self.max_attempts
        if limit is None and self.deadline is None:
            limit = ATTEMPTS_WITHOUT_DEADLINE
        answered = self.endpoint_answered if endpoint_answered is None else endpoint_answered
        if not answered and isinstance(failure, _CONNECT_FAILURES):
            limit = min(limit or UNANSWERED_ENDPOINT_ATTEMPTS, UNANSWERED_ENDPOINT_ATTEMPTS)
        return limit

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """Full jitter: uniform in ``[0, min(max_delay, base_delay * 2**(retry - 1))]``."""
        ceiling = min(self.max_delay, self.base_delay * 2 ** (retry - 1))
        return (rng or random).uniform(0.0, ceiling)


class RetryError(Exception):
    """Raised by :meth:`Tries.after` when retrying stops; ``last`` is the final
    failure."""

    def __init__(
        self, last: BaseException, attempts: int, *, out_of_time: bool, stalled: float = 0.0
    ) -> None:
        super().__init__(f"gave up after {attempts} attempt(s): {last!r}")
        self.last = last
        self.attempts = attempts
        self.out_of_time = out_of_time
        self.stalled = stalled  # seconds of silence, where the request stalled


def is_retryable(exc: BaseException) -> bool:
    """Whether another try of the same request can succeed (see the module docstring)."""
    if isinstance(exc, bce.ClientError):
        return _retryable_response(exc)
    if isinstance(exc, S3CkptError):  # already translated: its class says it all
        return isinstance(exc, TransientStorageError) and not isinstance(exc, StoreStalledError)
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


class Tries:
    """One request's tries under ``policy``, counted: the loop that sends them asks it,
    after each failure, whether another try may go and after how long (:meth:`after`).
    ``number`` is the try under way; past 1, it may repeat a request whose response was
    lost."""

    def __init__(
        self,
        policy: RetryPolicy,
        what: str = "request",
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.what = what
        self.clock = clock
        self.number = 1
        self.silent = 0  # consecutive tries stopped for silence

    def after(self, failure: Exception, *, endpoint_answered: bool | None = None) -> float:
        """The seconds to wait before the next try, try :attr:`number` having failed with
        ``failure``; the retry is counted (``policy.tally``). Raises ``failure`` itself
        where no retry can fix it, and :class:`RetryError` where retrying stops (the
        attempt cap, the deadline, the stall limit: ``stalled`` then holds the seconds of
        silence)."""
        policy, number = self.policy, self.number
        if not is_retryable(failure):
            raise failure
        self.silent = self.silent + 1 if is_stall(failure) else 0
        silence = policy.stalled(self.silent)
        if silence is not None:
            raise RetryError(failure, number, out_of_time=False, stalled=silence) from failure
        limit = policy.attempt_limit(failure, endpoint_answered=endpoint_answered)
        if limit is not None and number >= limit:
            raise RetryError(failure, number, out_of_time=False) from failure
        delay = policy.delay(number)
        if policy.deadline is not None and self.clock() + delay >= policy.deadline:
            raise RetryError(failure, number, out_of_time=True) from failure
        log.info(
            "%s failed (%s); retry %d%s in %.2fs",
            self.what,
            type(failure).__name__,
            number,
            f" of {limit - 1}" if limit is not None else "",
            delay,
        )
        if policy.tally is not None:
            policy.tally.retries += 1
        self.number += 1
        return delay
