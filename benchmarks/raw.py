"""The raw ceilings: aiobotocore with nothing on top, configured as fast as it goes.

Same client settings s3ckpt uses (path-style, no payload signing, no botocore checksums,
memoryview bodies), no DCP, no checksums of our own, no bookkeeping: what is left is the
HTTP stack and the server.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import torch
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession


def concat_bytes(state: dict[str, torch.Tensor]) -> memoryview:
    """All tensors' bytes back to back in one buffer (built before timing starts)."""
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
    return memoryview(flat.numpy()).cast("B")


def _uvloop_loop() -> asyncio.AbstractEventLoop:
    import uvloop

    return uvloop.new_event_loop()


class RawClient:
    """aiobotocore on its own loop thread; ``uvloop=True`` for the uvloop event loop."""

    def __init__(
        self, endpoint: str, concurrency: int, *, uvloop: bool = False, verify: str | None = None
    ) -> None:
        self.endpoint = endpoint
        self.concurrency = concurrency
        self.verify = verify  # the CA file of an HTTPS endpoint
        self.loop = _uvloop_loop() if uvloop else asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.client: Any = asyncio.run_coroutine_threadsafe(self._client(), self.loop).result()

    async def _client(self) -> Any:
        config = AioConfig(
            s3={"addressing_style": "path", "payload_signing_enabled": False},
            max_pool_connections=self.concurrency,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            parameter_validation=False,
        )
        return (
            await AioSession()
            .create_client("s3", endpoint_url=self.endpoint, config=config, verify=self.verify)
            .__aenter__()
        )

    def upload(self, bucket: str, key: str, payload: memoryview, part: int) -> None:
        asyncio.run_coroutine_threadsafe(
            self._upload(bucket, key, payload, part), self.loop
        ).result()

    def download(self, bucket: str, key: str, buffer: torch.Tensor, part: int) -> None:
        view = memoryview(buffer.numpy()).cast("B")
        asyncio.run_coroutine_threadsafe(
            self._download(bucket, key, view, part), self.loop
        ).result()

    async def _upload(self, bucket: str, key: str, payload: memoryview, part: int) -> None:
        created = await self.client.create_multipart_upload(Bucket=bucket, Key=key)
        upload_id = created["UploadId"]
        slots = asyncio.Semaphore(self.concurrency)

        async def send(number: int, start: int) -> dict[str, Any]:
            async with slots:
                response = await self.client.upload_part(
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=payload[start : start + part],
                )
            return {"PartNumber": number, "ETag": response["ETag"]}

        parts = await asyncio.gather(
            *(send(n, s) for n, s in enumerate(range(0, len(payload), part), start=1))
        )
        await self.client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": list(parts)}
        )

    async def _download(self, bucket: str, key: str, view: memoryview, part: int) -> None:
        slots = asyncio.Semaphore(self.concurrency)

        async def fetch(start: int) -> None:
            end = min(start + part, len(view))
            async with slots:
                response = await self.client.get_object(
                    Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}"
                )
                position = start
                async with response["Body"] as body:
                    while chunk := (await body.raw_stream.content.readchunk())[0]:
                        view[position : position + len(chunk)] = chunk
                        position += len(chunk)

        await asyncio.gather(*(fetch(s) for s in range(0, len(view), part)))
