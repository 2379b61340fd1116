"""Everything s3ckpt needs from aiobotocore beyond its public client API, in one place.

The internals s3ckpt relies on, each behind a function here:

* how aiobotocore's endpoint takes an answer from a ``before-send`` handler (the event is
  botocore's, :func:`s3ckpt.s3.compat_botocore.on_before_send`): it awaits a handler that
  is a coroutine function, and uses the first response returned, an
  ``aiobotocore.awsrequest.AioAWSResponse(url, status_code, headers, raw)`` whose body it
  reads with ``await raw.read()``, as if its HTTP session had received it
  (:func:`response`, for :mod:`s3ckpt.s3.wire.uploads`);
* where the client keeps its credentials (``client._request_signer._credentials``, an
  ``AioCredentials`` or ``AioRefreshableCredentials``, or None without any), and that
  their ``get_frozen_credentials()`` is a coroutine that refreshes them when they are
  about to expire (:func:`frozen_credentials`, for :mod:`s3ckpt.s3.wire.uploads`);
* what lies under the body of a streamed response (``response["Body"]``): its
  ``raw_stream`` is aiohttp's ``ClientResponse``, whose ``content``, an aiohttp
  ``StreamReader``, hands over each received buffer as is with ``readchunk()``
  (:func:`received_chunks`, for :mod:`s3ckpt.s3.get_attempt`).

``tests/unit/test_s3_compat.py`` fails loudly when an aiobotocore release changes any of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiobotocore.awsrequest import AioAWSResponse

Response = AioAWSResponse


class _Raw:
    """A response body already received whole, read as aiobotocore reads a raw body."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def read(self, *_: Any) -> bytes:
        return self.data


def response(url: str, status: int, headers: Mapping[str, str], body: bytes) -> Response:
    """A response for aiobotocore to parse as its own: what a ``before-send`` handler
    returns for a request it sent itself."""
    return AioAWSResponse(url, status, headers, _Raw(body))


async def frozen_credentials(client: Any) -> Any:
    """The credentials ``client`` signs with now (refreshed if they were about to
    expire), or None where it has none."""
    credentials = getattr(client._request_signer, "_credentials", None)
    if credentials is None:
        return None
    return await credentials.get_frozen_credentials()


def received_chunks(body: Any) -> Any:
    """The aiohttp ``StreamReader`` under a streamed response body (``response["Body"]``),
    whose ``readchunk()`` hands over each received buffer without joining them."""
    return body.raw_stream.content


__all__ = ["Response", "frozen_credentials", "received_chunks", "response"]
