"""Part uploads sent in batches by native threads that never take the GIL.

A save hands the data plane a batch of parts at a time (:meth:`SignedPuts.try_parts
<s3ckpt.s3.wire.uploads.SignedPuts.try_parts>`): each is signed on the event loop as any
part is, and then the whole batch goes to :mod:`s3ckpt.s3.wire._sender` in one call from
one worker thread. Its threads send every request from the tensor's memory on their own
kept-alive connections and read every answer with the GIL released; the worker takes
the GIL back once, when the batch is done. The sender frames each answer and
:func:`answer_of` splits its head.

Why: in thread mode the upload shares the trainer's interpreter. Sent one request at a
time from Python, a part takes the GIL back four times or more and runs its parsing and
bookkeeping with it, while the training loop waits; a batch takes it back once
(docs/decisions/0003-native-sender.md).

The sender's threads run at nice 19 (``_sender.c``; the record above): they never hold the GIL,
and the save's Python threads, which do, get the core first.

This is a transport only, and one try: every answer, every failure, goes back to the
caller's retry policy (:mod:`s3ckpt.s3.retry`) exactly as a part sent any other way
would, and a part whose answer the sender does not read (chunked, say) is marked
:class:`NotSent` and goes the usual way. Plain HTTP only; over HTTPS, through a proxy,
or where the C extension is not built, parts go one at a time.
"""

from __future__ import annotations

import asyncio
import errno
import functools
from typing import Any
from urllib.parse import SplitResult

from s3ckpt.s3.compat_botocore import connect_timeout, connection_failed, read_timeout
from s3ckpt.s3.wire.pool import ConnectionPool

try:
    from s3ckpt.s3.wire import _sender
except ImportError:  # pragma: no cover - exercised where no C compiler is available
    _sender = None  # type: ignore[assignment]

Answer = tuple[int, dict[str, str], bytes]
UNREAD = 1000  # _sender.c's ERR_UNREAD: an answer it does not read
CONNECT_FAILED = "connect:"  # how _sender.c's messages for failed connects begin


class NotSent(Exception):
    """The native sender left this request to the usual path."""


def native_batches() -> bool:
    """Whether the native sender is built here."""
    return _sender is not None


class NativeBatch:
    """Sends batches of requests to plain-HTTP origins on native threads, under the pool's
    timeouts, from one of the pool's worker threads."""

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool

    async def send(
        self, url: SplitResult, requests: list[tuple[bytes, memoryview]], connections: int
    ) -> list[Answer | Exception]:
        """For each ``(head, body)`` sent to ``url``'s origin on at most ``connections``
        connections: its answer (status, headers, body), or what failed it.

        Cancelled, the requests not yet started are skipped and those on the wire are
        waited for: nothing of the batch reaches the server after this returns."""
        if _sender is None:
            raise RuntimeError("the native sender is not built")
        endpoint = f"{url.scheme}://{url.netloc}"
        cancel = bytearray(1)
        call = functools.partial(
            _sender.exchange,
            url.hostname,
            url.port or 80,
            requests,
            connections,
            self.pool.connect_timeout,
            self.pool.read_timeout,
            cancel,
        )
        future = asyncio.get_running_loop().run_in_executor(self.pool.executor, call)
        try:
            raw = await asyncio.shield(future)
        except asyncio.CancelledError:
            cancel[0] = 1
            await asyncio.wait([future])
            raise
        except OSError as exc:  # the host name did not resolve
            return [connection_failed(endpoint, exc) for _ in requests]
        return [outcome(code, payload, endpoint) for code, payload in raw]


def answer_of(framed: bytes) -> Answer | Exception:
    """An answer the sender framed (status line, headers, a ``Content-Length`` or
    close-delimited body, nothing chunked): its status, headers (lower-case names) and
    body. Split here rather than fed to h11 (:class:`~.exchange.SmallResponse`), whose
    parsing is Python per part on the I/O loop, what batches exist to avoid
    (docs/decisions/0003-native-sender.md); malformed heads are refused as h11 refuses
    them."""
    head, _, body = framed.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        return ConnectionResetError(f"malformed HTTP response: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            return ConnectionResetError(f"malformed HTTP response header: {line[:80]!r}")
        headers[name.lower()] = value.strip()
    return int(code), headers, body


def outcome(code: int, payload: Any, endpoint: str) -> Answer | Exception:
    """One request's result from the sender: its parsed answer, or its failure as the data
    plane reports failures (:func:`s3ckpt.s3.wire.exchange.failure`)."""
    if code == 0:
        return answer_of(payload)
    if code == UNREAD or code == errno.ECANCELED:
        return NotSent(payload)
    if payload.startswith(CONNECT_FAILED):
        if code == errno.ETIMEDOUT:
            return connect_timeout(endpoint)
        return connection_failed(endpoint, OSError(code, payload))
    if code == errno.ETIMEDOUT:
        return read_timeout(endpoint)
    return ConnectionResetError(code, payload)
