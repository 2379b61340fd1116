"""Everything s3ckpt needs from aiohttp beyond its public client API, in one place.

The internals s3ckpt relies on, each behind a function here (all for
:class:`s3ckpt.s3.http_body.MemoryBody`, a request body written with no copy):

* a ``BytesPayload`` keeps the value it was made with, by reference, as ``_value``
  (:func:`payload_memory`);
* aiohttp's client writes a request body by calling the payload's
  ``write_with_length(writer, content_length)`` (aiohttp 3.12 and later; ``write(writer)``
  before), which ``MemoryBody`` overrides;
* the request's ``StreamWriter`` holds the request head back until the first write of
  the body and then sends both together (joined into one new ``bytes`` on Python before
  3.12.9); an empty write sends the head on its own, and a later write of a flat ``memoryview`` reaches the transport as
  that same ``memoryview`` (:func:`send_head`).

``tests/unit/test_s3_compat.py`` fails loudly when an aiohttp release changes any of them.
"""

from __future__ import annotations

from aiohttp.abc import AbstractStreamWriter
from aiohttp.payload import BytesPayload


def payload_memory(payload: BytesPayload) -> memoryview:
    """The memory ``payload`` was made with (a ``memoryview``, as given to it)."""
    value: memoryview = payload._value
    return value


async def send_head(writer: AbstractStreamWriter) -> None:
    """Send the request head that ``writer`` holds back, on its own."""
    await writer.write(b"")


__all__ = ["payload_memory", "send_head"]
