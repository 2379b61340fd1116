"""The one place where botocore and aiohttp exceptions become s3ckpt errors.

Callers match on exception classes, never on message strings. Messages name the
operation, bucket and key, and carry the server's error code; they never contain
credentials (botocore's own messages do not, and nothing here adds them).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from botocore import exceptions as bce

from s3ckpt.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    EndpointError,
    ObjectNotFoundError,
    PreconditionFailedError,
    S3CkptError,
    StorageError,
    TransientStorageError,
)

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
_PRECONDITION = {"PreconditionFailed", "412", "ConditionalRequestConflict"}
_TRANSIENT = {
    "SlowDown",
    "503",
    "500",
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestTimeTooSkewed",
}
_ENDPOINT_ERRORS = (
    bce.EndpointConnectionError,
    bce.ConnectTimeoutError,
    bce.ReadTimeoutError,
    bce.ConnectionClosedError,
    bce.SSLError,
    bce.ProxyConnectionError,
    bce.HTTPClientError,
)


def translate(
    exc: BaseException, *, operation: str, bucket: str | None = None, key: str | None = None
) -> S3CkptError:
    """The s3ckpt error for ``exc`` raised by ``operation`` on ``bucket``/``key``."""
    if isinstance(exc, S3CkptError):
        return exc
    where = f"s3://{bucket}/{key}" if key else (f"s3://{bucket}" if bucket else "")
    ctx = {"operation": operation, "bucket": bucket, "key": key}
    if isinstance(exc, bce.ClientError):
        error = exc.response.get("Error", {})
        code = str(
            error.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
        )
        message = error.get("Message") or ""
        text = f"{operation} {where} failed: {code}{': ' + message if message else ''}"
        cls = _class_for_code(code, key)
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
    if isinstance(exc, bce.BotoCoreError):
        return StorageError(f"{operation} {where} failed: {exc}", **ctx)
    return StorageError(f"{operation} {where} failed: {type(exc).__name__}: {exc}", **ctx)


def _class_for_code(code: str, key: str | None) -> type[StorageError]:
    if code in _NO_BUCKET:
        return BucketNotFoundError
    if code in _NOT_FOUND:
        return ObjectNotFoundError if key else BucketNotFoundError
    if code in _DENIED:
        return AccessDeniedError
    if code in _PRECONDITION:
        return PreconditionFailedError
    if code in _TRANSIENT:
        return TransientStorageError
    return StorageError


def _endpoint_reason(exc: BaseException) -> str:
    if isinstance(exc, bce.SSLError):
        return f"TLS error talking to the endpoint ({exc.kwargs.get('endpoint_url', '')}); check verify/CA bundle"
    if isinstance(exc, (bce.ConnectTimeoutError, bce.ReadTimeoutError)):
        return f"timed out talking to {exc.kwargs.get('endpoint_url', 'the endpoint')}"
    if isinstance(exc, bce.EndpointConnectionError):
        return f"could not connect to {exc.kwargs.get('endpoint_url', 'the endpoint')}"
    return f"connection to the endpoint failed ({type(exc).__name__})"


@contextlib.contextmanager
def translated(operation: str, bucket: str | None = None, key: str | None = None) -> Iterator[None]:
    """Re-raise anything but cancellation as the matching s3ckpt error."""
    try:
        yield
    except asyncio.CancelledError:
        raise
    except S3CkptError:
        raise
    except Exception as exc:
        raise translate(exc, operation=operation, bucket=bucket, key=key) from exc
