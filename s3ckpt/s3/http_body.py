"""Request bodies that reach the socket without being copied on the way.

Tensor bytes are handed to aiobotocore as a ``memoryview``. Two copies would still happen
in the HTTP stack: aiohttp (on Python < 3.12.9) joins the request headers and the whole
body into one new ``bytes`` before writing, and asyncio's selector transport copies
whatever the socket does not take at once into its own buffer. :class:`MemoryBody`
writes the headers alone and then the body as one ``memoryview``, which uvloop's
transport queues by reference, so the part goes from the tensor's memory to the kernel.

It also answers ``len()`` (botocore sizes the request with it) and ``seek(0)`` (botocore
rewinds bodies before a retry). What it relies on in aiohttp is in
:mod:`s3ckpt.s3.compat_aiohttp`.
"""

from __future__ import annotations

from typing import Any

from aiohttp.abc import AbstractStreamWriter
from aiohttp.payload import BytesPayload

from s3ckpt.s3.compat_aiohttp import payload_memory, send_head


class MemoryBody(BytesPayload):
    """A bytes-like request body written with no copy (see the module docstring)."""

    def __init__(self, value: bytes | bytearray | memoryview, **kwargs: Any) -> None:
        view = memoryview(value)
        super().__init__(view if view.format == "B" else view.cast("B"), **kwargs)

    def __len__(self) -> int:
        return len(self.view)

    @property
    def view(self) -> memoryview:
        """The body's memory, flat bytes (what the TLS path sends from, :mod:`s3ckpt.s3.tls_send`)."""
        return payload_memory(self)

    def seek(self, position: int, whence: int = 0) -> int:
        """Rewinding is free: every write starts from the beginning of the memory."""
        return 0

    def tell(self) -> int:
        return 0

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(
        self, writer: AbstractStreamWriter, content_length: int | None
    ) -> None:
        view = self.view if content_length is None else self.view[:content_length]
        await send_head(writer)
        await writer.write(view)
