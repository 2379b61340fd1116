"""One attempt of a ranged GET into a sink through aiobotocore.

:meth:`s3ckpt.s3.store.ObjectStore.read_range` retries, each try sent by the client's
transport (:mod:`s3ckpt.s3.transport`). Both transports deliver the bytes of
``[start, end)`` to the sink in offset order, each once: the data plane
(:mod:`s3ckpt.s3.wire.gets`) lets the socket write into the sink's memory; this path
copies each received buffer in. A server that ignores ``Range`` and sends the whole
object is cut to the range on both.
"""

from __future__ import annotations

from typing import Any

from s3ckpt.errors import StorageError
from s3ckpt.s3 import retry
from s3ckpt.s3.compat_aiobotocore import received_chunks
from s3ckpt.s3.wire import RangeSink, copy_into, warn_range_ignored


async def stream(
    client: Any, endpoint: str, bucket: str, key: str, start: int, end: int, sink: RangeSink
) -> None:
    """One ranged GET through ``client`` (of ``endpoint``, named in warnings);
    :class:`retry.ShortReadError` if it ends early."""
    response = await client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
    position = _body_offset(response, start, f"s3://{bucket}/{key}", endpoint)
    async with response["Body"] as body:
        # readchunk() hands over one received buffer as is; readany() and
        # read(n) join everything buffered into a new bytes object first.
        content = received_chunks(body)
        while position < end:
            chunk, _ = await content.readchunk()
            if not chunk:
                break
            useful = memoryview(chunk)[max(start - position, 0) : end - position]
            if useful:
                copy_into(sink, max(position, start), useful)
            position += len(chunk)
    if position < end:
        raise retry.ShortReadError(
            f"the response ended after {position - start} of {end - start} bytes"
        )


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
