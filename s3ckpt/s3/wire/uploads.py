"""Upload bodies sent from memory: the answer to botocore's ``before-send`` for part
uploads and PUTs.

aiobotocore still builds, signs and parses every request. :class:`BodySender` is a
handler of botocore's ``before-send`` event for ``UploadPart`` and ``PutObject``, the hook
botocore offers for answering a request without its HTTP stack: it writes the signed
request (every header as signed; ``Expect``, which is never signed, left out) and then
the body, straight from the ``memoryview`` of the tensor, on a kept-alive connection of
the pool, and returns the response to botocore, which parses it as its own: status
codes, ``ClientError`` s, ETags and checksums are exactly those of aiohttp's path, and so
are :mod:`s3ckpt.s3.retry` and :mod:`s3ckpt.s3.error_mapping`. Bodies that are not plain
memory go through aiohttp. The hook and the response it returns are botocore's and
aiobotocore's internals (:mod:`s3ckpt.s3.compat_botocore`, :mod:`s3ckpt.s3.compat_aiobotocore`).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from s3ckpt._version import __version__
from s3ckpt.s3.compat_aiobotocore import Response, response
from s3ckpt.s3.compat_botocore import on_before_send
from s3ckpt.s3.wire import on_loop
from s3ckpt.s3.wire.exchange import send_request
from s3ckpt.s3.wire.pool import ConnectionPool

OPERATIONS = ("UploadPart", "PutObject")
# Headers this module writes itself, or that must not be sent as botocore left them.
_OWN_HEADERS = frozenset({"host", "content-length", "expect", "transfer-encoding", "connection"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


class BodySender:
    """The ``before-send`` handler that sends upload bodies on the pool's connections."""

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool

    def register(self, client: Any) -> None:
        for operation in OPERATIONS:
            on_before_send(client, operation, self)

    async def __call__(self, request: Any, **_: Any) -> Response | None:
        body = memory_of(request.body)
        url = urlsplit(request.url)
        if body is None or url.scheme not in _DEFAULT_PORTS or not url.hostname:
            return None  # aiohttp sends it
        head = request_head(request.method, url, request.headers, len(body))
        origin = (url.scheme, url.hostname, url.port or _DEFAULT_PORTS[url.scheme])
        if url.scheme == "https":  # encrypted in a worker thread, the GIL released
            status, headers, content = await self.pool.run(
                origin, lambda connection: send_request(connection, head, body)
            )
        else:
            status, headers, content = await on_loop.send_request(self.pool, origin, head, body)
        return response(request.url, status, headers, content)


def memory_of(body: Any) -> memoryview | None:
    """The request body as one flat ``memoryview``, or None for bodies of other kinds."""
    if isinstance(body, (bytes, bytearray, memoryview)):
        view = memoryview(body)
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    return None


def request_head(method: str, url: Any, headers: Any, length: int) -> bytes:
    """The request line and headers as signed, with ``Host`` and ``Content-Length``."""
    # SigV4 signs the host without the scheme's default port, as aiohttp sends it.
    default = f":{_DEFAULT_PORTS.get(url.scheme, 0)}"
    host = url.netloc[: -len(default)] if url.netloc.endswith(default) else url.netloc
    target = f"{url.path or '/'}?{url.query}" if url.query else url.path or "/"
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", f"Content-Length: {length}"]
    for name, value in headers.items():
        if name.lower() in _OWN_HEADERS:
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        lines.append(f"{name}: {text}")
    if "user-agent" not in {name.lower() for name in headers}:
        lines.append(f"User-Agent: s3ckpt/{__version__}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
