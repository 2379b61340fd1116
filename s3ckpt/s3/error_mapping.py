"""The one place where botocore and aiohttp exceptions become s3ckpt errors.

Callers match on exception classes, never on message strings. Messages name the
operation, bucket and key, and carry the server's error code; they never contain
credentials (botocore's own messages do not, and nothing here adds them). Whether a
failure is retried is decided earlier, on the raw exception, by :mod:`s3ckpt.s3.retry`;
:func:`translate_final` words the error that ends the retries.

An answer that is not S3's becomes :class:`~s3ckpt.errors.NotS3EndpointError`, naming
the endpoint and the status: botocore reads an error with no S3 error document as the
code ``"404"`` (the status) with the reason phrase as its message, which would otherwise
read as a missing bucket or key. S3 answers every request but a HEAD with an XML error
document, so such an answer to any other request is not S3's; a HEAD's error has no body,
so a HEAD's bare ``404`` keeps its meaning unless the answer is a web page: HTML, with
none of the ``x-amz`` headers every S3 server sends (some, moto among them, label their
empty answers ``text/html``). Bare statuses that stores do send without a body (``405``
and ``501`` for what they do not implement, :data:`UNSUPPORTED_CODES`) and those retried
(throttling, 5xx) keep theirs too, unless the answer is a web page; a gateway's page
(502, 503, 504, a proxy in front of a store that may be fine) stays transient. A web
page that answered ``200`` where botocore expects XML is retried as a 500 (botocore reads
an unreadable ``200`` as one) and then named with the ``200`` it was. A web page answering ``HeadBucket`` or a
request with ``200`` is caught by :func:`check_s3_answer`.

A store with no room left says so in its own words (:data:`FULL_CODES`,
:data:`TOO_LARGE_CODES`: ``507``, ``QuotaExceeded``, ``XMinioStorageFull``,
``EntityTooLarge``...): those become :class:`~s3ckpt.errors.StoreFullError`, whose message
says the store is full, over quota, or the object too large. A store that stops reading
without answering (some do when full) is found by the stall limit of
:mod:`s3ckpt.s3.retry`, worded here as :class:`~s3ckpt.errors.StoreStalledError`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import aiohttp
import h11
from botocore import exceptions as bce
from botocore.parsers import ResponseParserError

from s3ckpt.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    DeadlineExceededError,
    EndpointError,
    NotS3EndpointError,
    ObjectNotFoundError,
    PreconditionFailedError,
    S3CkptError,
    StorageError,
    StoreFullError,
    StoreStalledError,
    TransientStorageError,
)
from s3ckpt.s3 import retry
from s3ckpt.s3.compat_botocore import answered_status, answering_endpoint, cause, failed_endpoint
from s3ckpt.s3.retry import ShortReadError

_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_NO_BUCKET = {"NoSuchBucket"}
_DENIED = {
    "AccessDenied",
    "403",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "AllAccessDisabled",
}
PRECONDITION_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict"})
# What a store answers to a request or header it does not implement (a conditional PUT,
# ListMultipartUploads, If-Match on DELETE): s3ckpt then takes its documented fallback.
UNSUPPORTED_CODES = frozenset(
    {"NotImplemented", "501", "MethodNotAllowed", "405", "InvalidRequest", "InvalidArgument"}
)
# What stores answer when they have no room for the bytes: S3's and RGW's quota error,
# HTTP 507 (a bare status, or RGW's and others' code for it), MinIO's full disks, and the
# object over the store's size limit. Not retried (none is in retry.RETRYABLE_CODES).
FULL_CODES = frozenset(
    {"QuotaExceeded", "InsufficientStorage", "507", "XMinioStorageFull", "StorageFull"}
)
TOO_LARGE_CODES = frozenset({"EntityTooLarge", "XMinioEntityTooLarge"})
# What a gateway in front of a store answers, with its own page, while the store is down.
_GATEWAY = frozenset({502, 503, 504})
# Operations S3 answers with no body, errors included.
_BODILESS = frozenset({"HeadObject", "HeadBucket"})
NOT_S3 = "this endpoint does not answer like an S3 server"
_ENDPOINT_ERRORS = (
    bce.EndpointConnectionError,
    bce.ConnectTimeoutError,
    bce.ReadTimeoutError,
    bce.ConnectionClosedError,
    bce.SSLError,
    bce.ProxyConnectionError,
    bce.HTTPClientError,
    bce.IncompleteReadError,
)


def error_code(exc: bce.ClientError) -> str:
    """The S3 error code of ``exc``, or its HTTP status when the body had none (HEAD)."""
    error = exc.response.get("Error", {})
    return str(
        error.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
    )


def translate(
    exc: BaseException, *, operation: str, bucket: str | None = None, key: str | None = None
) -> S3CkptError:
    """The s3ckpt error for ``exc`` raised by ``operation`` on ``bucket``/``key``."""
    if isinstance(exc, S3CkptError):
        return exc
    where = f"s3://{bucket}/{key}" if key else (f"s3://{bucket}" if bucket else "")
    ctx = {"operation": operation, "bucket": bucket, "key": key}
    if isinstance(exc, bce.ClientError) and not_s3_error(exc, operation):
        metadata = exc.response.get("ResponseMetadata", {})
        status = answered_status(exc.response) or metadata.get("HTTPStatusCode")
        return _not_s3(
            exc.response,
            operation,
            where,
            f"HTTP {status}",
            code=str(status),
            bucket=bucket,
            key=key,
        )
    if isinstance(exc, ResponseParserError):
        return NotS3EndpointError(
            f"{NOT_S3}: the endpoint answered {operation} {where} with a body that is not "
            "S3's XML; check the endpoint URL (--endpoint-url, AWS_ENDPOINT_URL)",
            **ctx,
        )
    if isinstance(exc, bce.ClientError):
        code = error_code(exc)
        message = exc.response.get("Error", {}).get("Message") or ""
        detail = f"{operation} {code}{': ' + message if message else ''}"
        cls = _class_for_code(code, key, retry.is_retryable(exc))
        if cls is BucketNotFoundError:
            text = f"no such bucket: s3://{bucket} ({detail})"
        elif cls is AccessDeniedError:
            text = f"access denied to {where or 'the store'}: check the credentials ({detail})"
        elif cls is StoreFullError:
            text = _full_message(code, operation, where, detail)
        else:
            text = f"{operation} {where} failed: {code}{': ' + message if message else ''}"
        return cls(text, code=code, **ctx)
    if isinstance(exc, (bce.NoCredentialsError, bce.PartialCredentialsError)):
        return AccessDeniedError(
            f"{operation} {where} failed: no usable AWS credentials found "
            "(set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, or pass credentials)",
            **ctx,
        )
    if isinstance(exc, _ENDPOINT_ERRORS):
        return EndpointError(f"{operation} {where} failed: {_endpoint_reason(exc)}", **ctx)
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return EndpointError(f"{operation} {where} timed out", **ctx)
    if isinstance(exc, (aiohttp.ClientError, ShortReadError, ConnectionError)):
        return EndpointError(f"{operation} {where} failed: {_stream_reason(exc)}", **ctx)
    if isinstance(exc, bce.BotoCoreError):
        return StorageError(f"{operation} {where} failed: {exc}", **ctx)
    return StorageError(f"{operation} {where} failed: {type(exc).__name__}: {exc}", **ctx)


def not_s3_error(exc: bce.ClientError, operation: str) -> bool:
    """Whether an error answer is not S3's (see the module docstring): no S3 error code,
    a status S3 always explains in an XML body, or an HTML page."""
    metadata = exc.response.get("ResponseMetadata", {})
    status = metadata.get("HTTPStatusCode")
    code = exc.response.get("Error", {}).get("Code")
    if not isinstance(status, int) or status < 400 or (code and code != str(status)):
        return False
    if _web_page(metadata):
        return status not in _GATEWAY  # a proxy's page, in front of a store that may be fine
    if retry.is_retryable(exc):
        return False
    return operation not in _BODILESS and str(status) not in UNSUPPORTED_CODES | FULL_CODES


def check_s3_answer(
    operation: str, response: dict[str, Any], bucket: str | None, key: str | None = None
) -> None:
    """Raise :class:`~s3ckpt.errors.NotS3EndpointError` for a successful answer that is a
    web page (a web server's ``200``): S3 answers with its ``x-amz`` headers, always
    (an object stored as ``text/html`` comes back with them too). Every request of
    :class:`~s3ckpt.s3.requests.Requests` is checked; an answer without metadata (a part
    upload's, built by the data plane) has nothing to check."""
    metadata = response.get("ResponseMetadata")
    if metadata and _web_page(metadata):
        where = f"s3://{bucket}/{key}" if key else (f"s3://{bucket}" if bucket else "")
        status = metadata.get("HTTPStatusCode")
        raise _not_s3(
            response, operation, where, f"HTTP {status}", code=str(status), bucket=bucket, key=key
        )


def _web_page(metadata: dict[str, Any]) -> bool:
    """An HTML answer without a single ``x-amz`` header (``x-amz-request-id``, moto's
    ``x-amzn-requestid``): a web server's, not an S3 server's."""
    headers = {str(k).lower(): str(v) for k, v in (metadata.get("HTTPHeaders") or {}).items()}
    if any(name.startswith("x-amz") for name in headers):
        return False
    content_type = headers.get("content-type", "").split(";")[0].strip().lower()
    return content_type in ("text/html", "application/xhtml+xml")


def _not_s3(
    response: dict[str, Any], operation: str, where: str, status: str, **ctx: Any
) -> NotS3EndpointError:
    metadata = response.get("ResponseMetadata", {})
    endpoint = answering_endpoint(response) or "the endpoint"
    body = "a web page" if _web_page(metadata) else "no S3 error"
    return NotS3EndpointError(
        f"{NOT_S3}: {endpoint} answered {operation} {where} with {status} and {body}; "
        "check the endpoint URL (--endpoint-url, AWS_ENDPOINT_URL)",
        operation=operation,
        **ctx,
    )


def _full_message(code: str, operation: str, where: str, detail: str) -> str:
    """What a "no room" answer means, said plainly."""
    if code in TOO_LARGE_CODES:
        what = "the object is larger than the store accepts"
        hint = "a smaller part_size or max_object_size keeps objects within its limit"
    elif code in ("QuotaExceeded",):
        what = "the bucket (or its owner) is over its quota on the store"
        hint = "raise the quota, or free space (s3ckpt prune, s3ckpt gc)"
    else:
        what = "the store is full: it has no room for more bytes"
        hint = "free space (s3ckpt prune, s3ckpt gc) or add capacity"
    return f"{operation} {where} refused: {what} ({detail}); {hint}"


def _class_for_code(code: str, key: str | None, retryable: bool) -> type[StorageError]:
    """The error class of an S3 error response; what :mod:`s3ckpt.s3.retry` retries (and
    so only gives up on after every attempt) is a :class:`TransientStorageError`."""
    if code in FULL_CODES or code in TOO_LARGE_CODES:
        return StoreFullError
    if code in _NO_BUCKET:
        return BucketNotFoundError
    if code in _NOT_FOUND:
        return ObjectNotFoundError if key else BucketNotFoundError
    if code in _DENIED:
        return AccessDeniedError
    if code in PRECONDITION_CODES:
        return PreconditionFailedError
    if retryable:
        return TransientStorageError
    return StorageError


def _endpoint_reason(exc: BaseException) -> str:
    if isinstance(exc, bce.SSLError):
        error = cause(exc)
        # aiohttp wraps the ssl module's error (certificate_error); the TLS path raises it.
        inner = getattr(error, "certificate_error", error)
        detail = getattr(inner, "verify_message", None)
        what = f"TLS certificate verification failed ({detail})" if detail else "TLS error"
        return f"{what} talking to {failed_endpoint(exc, 'the endpoint')}; check verify/CA bundle"
    if isinstance(exc, (bce.ConnectTimeoutError, bce.ReadTimeoutError)):
        return f"timed out talking to {failed_endpoint(exc, 'the endpoint')}"
    if isinstance(exc, bce.EndpointConnectionError):
        return f"could not connect to {failed_endpoint(exc, 'the endpoint')}"
    return f"connection to the endpoint failed ({type(exc).__name__})"


def _stream_reason(exc: BaseException) -> str:
    """Failures of a response body read straight from aiohttp (ranged GETs)."""
    if isinstance(exc, aiohttp.ClientSSLError):
        return "TLS error talking to the endpoint; check verify/CA bundle"
    if isinstance(exc, ShortReadError):
        return str(exc)
    return f"the connection dropped ({type(exc).__name__})"


def translate_final(
    last: BaseException,
    attempts: int,
    *,
    out_of_time: bool,
    operation: str,
    bucket: str | None = None,
    key: str | None = None,
    stalled: float = 0.0,
    last_answer: str = "",
) -> S3CkptError:
    """The error for a request that was retried and still failed (``last`` failure);
    ``stalled``: the seconds of silence after which the stall limit stopped it
    (:mod:`s3ckpt.s3.retry`), and ``last_answer`` what the store last answered."""
    error = translate(last, operation=operation, bucket=bucket, key=key)
    if not isinstance(error, StorageError):
        return error
    ctx = {"operation": operation, "code": error.code, "bucket": bucket, "key": key}
    if stalled:
        where = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
        return StoreStalledError(
            f"{operation} {where} stalled: the store moved no byte of it and sent no "
            f"answer for {stalled:.0f} s ({attempts} tries; S3Config.stall_timeout_s); "
            f"{last_answer or 'no earlier answer is known'}. A store that is full or "
            "overloaded may stop reading instead of answering: the save (or load) ends "
            "now rather than at its deadline (S3Config.deadline_s)",
            **ctx,
        )
    if out_of_time:
        return DeadlineExceededError(
            f"{error}; not retried after {attempts} attempt(s): the time budget of this save "
            "or load (S3Config.deadline_s) is spent",
            **ctx,
        )
    return type(error)(f"{error} (gave up after {attempts} attempts)", **ctx)


# What a request can fail with that is the store's or the network's doing: S3's answers,
# botocore's and aiohttp's transport errors, h11's protocol errors on the TLS path, the
# operating system's socket and TLS errors, timeouts, short bodies. Anything else is a bug
# (in s3ckpt or in a library it calls) and propagates as itself: it is neither worded as
# a failed request nor retried.
STORE_ERRORS: tuple[type[BaseException], ...] = (
    bce.BotoCoreError,
    bce.ClientError,
    aiohttp.ClientError,
    h11.ProtocolError,
    OSError,
    asyncio.TimeoutError,
    TimeoutError,
    ShortReadError,
    ResponseParserError,
)


@contextlib.contextmanager
def translated(operation: str, bucket: str | None = None, key: str | None = None) -> Iterator[None]:
    """Re-raise the store's and the network's failures (:data:`STORE_ERRORS`) as the
    matching s3ckpt error; everything else, cancellation and bugs included, unchanged."""
    try:
        yield
    except S3CkptError:
        raise
    except STORE_ERRORS as exc:
        raise translate(exc, operation=operation, bucket=bucket, key=key) from exc
