"""One attempt of a ranged GET through aiobotocore, its body pulled into the caller's memory.

:meth:`s3ckpt.s3.store.ObjectStore.open_range` retries, each try opened by the client's
transport (:mod:`s3ckpt.s3.transport`). Both transports deliver the bytes of
``[start, end)`` into the memory each receive names, in offset order, each once: the
data plane (:mod:`s3ckpt.s3.wire.get_exchange`) lets the socket write into it; this path
copies each buffer aiohttp received in. A server that ignores ``Range`` and sends the whole
object is cut to the range on both.
"""

from __future__ import annotations

from typing import Any

from s3ckpt.errors import StorageError
from s3ckpt.s3 import retry
from s3ckpt.s3.compat_aiobotocore import received_chunks
from s3ckpt.s3.wire import warn_range_ignored


async def open_range(
    client: Any, endpoint: str, bucket: str, key: str, start: int, end: int
) -> ClientRangeBody:
    """One ranged GET through ``client`` (of ``endpoint``, named in warnings): its body,
    to pull from and then close."""
    response = await client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
    body = response["Body"]
    try:
        position = _body_offset(response, start, f"s3://{bucket}/{key}", endpoint)
    except BaseException:
        await body.aclose()
        raise
    return ClientRangeBody(body, position, start, end)


class ClientRangeBody:
    """The body of one ranged GET as aiohttp receives it, copied into the memory each
    :meth:`receive_into` names; ``position``: where in the object the body starts."""

    def __init__(self, body: Any, position: int, start: int, end: int) -> None:
        self.body = body
        # readchunk() hands over one received buffer as is; readany() and
        # read(n) join everything buffered into a new bytes object first.
        self.content = received_chunks(body)
        self.position = position  # the object offset after the last chunk taken
        self.start = start
        self.end = end
        self.delivered = start  # the next byte of the range to deliver
        self.pending = memoryview(b"")  # bytes of the range taken, not yet delivered
        self.error: Exception | None = None  # what ended the body after bytes were delivered

    async def receive_into(self, view: memoryview) -> int:
        if self.error is not None:
            raise self.error
        view = view[: self.end - self.delivered]
        filled = 0
        while filled < len(view):
            if not self.pending:
                try:
                    await self._take()
                except Exception as exc:
                    if not filled:
                        raise
                    # the bytes that came are delivered (a retry resumes after them);
                    # the error is the next receive's
                    self.error = exc
                    break
                continue
            count = min(len(self.pending), len(view) - filled)
            view[filled : filled + count] = self.pending[:count]
            self.pending = self.pending[count:]
            filled += count
        self.delivered += filled
        return filled

    async def aclose(self) -> None:
        await self.body.aclose()

    async def _take(self) -> None:
        """The next received chunk's bytes within the range into :attr:`pending`."""
        chunk, _ = await self.content.readchunk()
        if not chunk:
            raise retry.ShortReadError(
                f"the response ended after {self.position - self.start} of "
                f"{self.end - self.start} bytes"
            )
        position = self.position
        self.position += len(chunk)
        self.pending = memoryview(chunk)[max(self.start - position, 0) : self.end - position]


def _body_offset(response: dict[str, Any], start: int, where: str, endpoint: str) -> int:
    """Where in the object a ranged GET's body starts: ``start`` for a ``206`` that honours
    the range, 0 for a server that ignored ``Range`` and sent the whole object (``200``),
    whose leading bytes the caller then skips."""
    status = response["ResponseMetadata"]["HTTPStatusCode"]
    if status == 200:
        warn_range_ignored(endpoint)
        return 0
    first = str(response.get("ContentRange", "")).removeprefix("bytes ").partition("-")[0]
    if not first.isdigit() or int(first) > start:
        raise StorageError(
            f"GetObject {where}: the server answered bytes {response.get('ContentRange')!r} "
            f"to a request for bytes from {start}",
            operation="GetObject",
        )
    return int(first)
