"""Where the bytes of one ranged GET go: the memory a sink names, asked for as they arrive.

The transport receives a response body straight into the memory :meth:`RangeSink.buffer`
returns (usually the destination tensor), so each byte is copied once, by the kernel (or
by OpenSSL as it decrypts). A sink is called on the event loop's thread as its response
arrives, one response's calls in offset order; a sink shared by several responses (a read
target split over requests) sees their calls interleaved. A retried GET resumes at the
first byte not delivered, which :class:`ResumingSink` records as the transport fills it.
"""

from __future__ import annotations

from typing import Protocol


class RangeSink(Protocol):
    """Where the bytes of one ranged GET go, asked for as they arrive, in offset order."""

    def buffer(self, offset: int) -> memoryview:
        """Writable memory for the bytes starting at ``offset`` (non-empty)."""
        ...

    def filled(self, offset: int, nbytes: int) -> None:
        """``nbytes`` bytes at ``offset`` have been written into the last buffer given."""
        ...


def copy_into(sink: RangeSink, offset: int, chunk: bytes | bytearray | memoryview) -> None:
    """Hand ``chunk`` (received elsewhere, e.g. by aiohttp) to ``sink`` by copying it."""
    view = memoryview(chunk)
    done = 0
    while done < len(view):
        target = sink.buffer(offset + done)
        count = min(len(target), len(view) - done)
        target[:count] = view[done : done + count]
        sink.filled(offset + done, count)
        done += count


class ResumingSink:
    """``sink``, filled from ``start`` on, recording how far its range has been delivered:
    where a retry of the GET resumes (:attr:`position`)."""

    def __init__(self, sink: RangeSink, start: int) -> None:
        self.sink = sink
        self.position = start

    def buffer(self, offset: int) -> memoryview:
        return self.sink.buffer(offset)

    def filled(self, offset: int, nbytes: int) -> None:
        self.sink.filled(offset, nbytes)
        self.position = offset + nbytes
