"""One attempt of a ranged GET into a sink: the data plane where it can, else aiobotocore.

:meth:`s3ckpt.s3.store.ObjectStore.read_range` retries; this module makes one attempt.
Both paths deliver the bytes of ``[start, end)`` to the sink in offset order, each once:
the data plane (:mod:`s3ckpt.s3.wire.gets`) lets the socket write into the sink's
memory; the aiobotocore path copies each received buffer in. A server that ignores
``Range`` and sends the whole object is cut to the range on both.
"""

from __future__ import annotations

from typing import Any

from s3ckpt.config import S3Config
from s3ckpt.errors import StorageError
from s3ckpt.s3 import retry
from s3ckpt.s3.client import client_handle
from s3ckpt.s3.compat_aiobotocore import received_chunks
from s3ckpt.s3.wire import RangeSink, UnsupportedResponse, copy_into, warn_range_ignored


class ResumingSink:
    """A sink that remembers how far its range has been delivered (where a retry resumes)."""

    def __init__(self, sink: RangeSink, start: int) -> None:
        self.sink = sink
        self.position = start

    def buffer(self, offset: int) -> memoryview:
        return self.sink.buffer(offset)

    def filled(self, offset: int, nbytes: int) -> None:
        self.sink.filled(offset, nbytes)
        self.position = offset + nbytes


async def receive(
    config: S3Config, bucket: str, key: str, start: int, end: int, sink: RangeSink
) -> None:
    """One ranged GET: on the data plane unless the endpoint answered it oddly once."""
    handle = client_handle(config)
    gets = await handle.ranged_gets()
    if gets is not None:
        try:
            async with handle.slots:
                await gets.read(bucket, key, start, end, sink)
            return
        except UnsupportedResponse as exc:
            handle.stop_ranged_gets(str(exc))
    await stream(config, bucket, key, start, end, sink)


async def stream(
    config: S3Config, bucket: str, key: str, start: int, end: int, sink: RangeSink
) -> None:
    """One ranged GET through aiobotocore; :class:`retry.ShortReadError` if it ends early."""
    handle = client_handle(config)
    client = await handle.get()
    async with handle.slots:
        response = await client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
        position = _body_offset(response, start, f"s3://{bucket}/{key}", config)
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


def _body_offset(response: dict[str, Any], start: int, where: str, config: S3Config) -> int:
    """Where in the object a ranged GET's body starts: ``start`` for a ``206`` that honours
    the range, 0 for a server that ignored ``Range`` and sent the whole object (``200``),
    whose leading bytes the caller then skips."""
    status = response["ResponseMetadata"]["HTTPStatusCode"]
    if status == 200:
        warn_range_ignored(config.endpoint_url or "the endpoint")
        return 0
    first = str(response.get("ContentRange", "")).removeprefix("bytes ").partition("-")[0]
    if not first.isdigit() or int(first) > start:
        raise StorageError(
            f"GetObject {where}: the server answered bytes {response.get('ContentRange')!r} "
            f"to a request for bytes from {start}",
            operation="GetObject",
        )
    return int(first)
