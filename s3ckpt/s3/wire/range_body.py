"""What a ranged GET's body is to the one who reads it: bytes pulled into memory it names.

The caller owns the loop: it asks for the next bytes of the range into a buffer of its
own (usually the destination tensor), and the transport receives them straight into it
(the kernel, or OpenSSL as it decrypts, writing into the caller's memory), answering once
the buffer is full or the range is in. Nothing is read while no receive is pending.
"""

from __future__ import annotations

from typing import Protocol


class RangeBody(Protocol):
    """The body of one try of a ranged GET, its head already read; closed by its opener."""

    async def receive_into(self, view: memoryview) -> int:
        """Receive the next bytes of the range into ``view``: the count, ``len(view)``
        unless the range ends first, or fewer where the response failed after bytes landed
        (they count: a retry resumes after them; the failure is the next receive's).
        :class:`~s3ckpt.s3.retry.ShortReadError` where the response ends before the range
        does."""
        ...

    async def aclose(self) -> None:
        """Stop receiving; the connection serves again only where the body was read whole."""
        ...
