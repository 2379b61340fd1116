"""Upload bodies sent from memory: part uploads and whole-object PUTs built and signed
here; the PUTs the client still sends answered for botocore.

Both send the request's head and then its body, straight from the ``memoryview`` of the
tensor, on a kept-alive connection of the pool (:class:`~.on_loop.BodyTransport`): from
the event loop over plain HTTP, from a worker thread over TLS, where encryption runs with
the GIL released.

* **UploadPart** (:class:`SignedPuts`), almost every request of a save, never enters the
  client's request machinery: the part's URL is the object's (addressed as the client
  addresses it, learnt once per object from a presigned URL, which also names the
  signing region), signed with the client's credentials exactly as botocore's SigV4
  signer signs it for s3ckpt's client (:mod:`~.signing`, checked against botocore's in
  the tests), and an error answer is parsed by the client's own response parser
  into the ``ClientError`` it would raise, so :mod:`s3ckpt.s3.retry` and
  :mod:`s3ckpt.s3.error_mapping` see exactly what they saw through the client. The
  client's per-request Python (event hooks, endpoint rules, a second signing pass, the
  user-agent string, parsing) runs on the I/O loop's thread, which a training loop
  beside a thread-mode save waits for
  (docs/decisions/0005-requests-signed-on-the-data-plane.md). A redirect (a bucket in
  another region) fails that part with the client's error, and the data plane's
  transport (:class:`~.data_plane.DataPlane`) sends every later one through the client,
  which knows how to follow it.
* **PutObject** of whole objects as :meth:`ObjectStore.put
  <s3ckpt.s3.store.ObjectStore.put>` sends them (a body; a CRC32C, ``If-None-Match: *``
  and a content type where given): four a save, each checkpoint's marker, index,
  metadata and manifest, built, signed and answered the same way. The object's URL is
  derived from one presigned URL per bucket (:mod:`~.addresses`) rather than presigned
  per key: a presign is Python of its own, and these keys are new every save. Sent
  through the client, the four would fall where a thread-mode save's Python bunches up,
  as its upload ends and commits. A redirected PutObject raises :class:`Redirected`
  (nothing was stored): the transport sends it again, and every later one, through the
  client, which follows the redirect. A PutObject with any other
  parameter goes through the client, whose ``before-send`` this module answers
  (:class:`BodySender`, the hook botocore offers for answering a request without its
  HTTP stack) with the response it received, which botocore parses as its own.

The hooks, the signer, the parser and the credentials are botocore's and aiobotocore's
internals (:mod:`s3ckpt.s3.compat_botocore`, :mod:`s3ckpt.s3.compat_aiobotocore`).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import SplitResult, urlsplit

from botocore.exceptions import ClientError

from s3ckpt._version import __version__
from s3ckpt.s3.compat_aiobotocore import Response, frozen_credentials, response
from s3ckpt.s3.compat_botocore import answered_status, client_error, no_credentials, on_before_send
from s3ckpt.s3.wire.addresses import ObjectAddresses
from s3ckpt.s3.wire.batch import Answer, NativeBatch
from s3ckpt.s3.wire.on_loop import BodyTransport
from s3ckpt.s3.wire.signing import PartHeads, PartSigner

# Headers this module writes itself, or that must not be sent as botocore left them.
_OWN_HEADERS = frozenset({"host", "content-length", "expect", "transfer-encoding", "connection"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_BODILESS = frozenset({"GET", "HEAD"})
_USER_AGENT = f"s3ckpt/{__version__}"
# PutObject parameters the data plane sends, and their headers (as botocore writes them).
_PUT_HEADERS = {
    "ChecksumCRC32C": "x-amz-checksum-crc32c",
    "IfNoneMatch": "If-None-Match",
    "ContentType": "Content-Type",
}


class Redirected(Exception):
    """The endpoint answered a request of the data plane with a redirect, and nothing was
    stored: the client, which follows redirects, sends it instead."""


def is_redirect(outcome: object) -> bool:
    """Whether ``outcome`` is the client's error for a redirect answer (a part's)."""
    if not isinstance(outcome, ClientError):
        return False
    return 300 <= (answered_status(outcome.response) or 0) < 400


class SignedPuts:
    """The PUTs that carry an upload body, UploadPart and PutObject, of ``client``'s bucket
    objects: built, signed and answered on the data plane (see the module's docstring)."""

    def __init__(
        self, client: Any, transport: BodyTransport, batch: NativeBatch | None = None
    ) -> None:
        self.client = client
        self.transport = transport
        self.batch = batch  # where batches of parts are sent by native threads
        self.signer = PartSigner()
        self.addresses = ObjectAddresses(client)

    async def upload_part(
        self,
        bucket: str,
        key: str,
        upload_id: str,
        part_number: int,
        body: memoryview,
        checksum: str | None,
    ) -> dict[str, Any]:
        """One try of UploadPart; the answer's ``ETag`` (and checksum) as the client's
        ``upload_part`` returns them. Errors are the client's ``ClientError`` s (a
        redirect's too: :func:`is_redirect`)."""
        base, region, service = await self.addresses.presigned(bucket, key)
        heads = await self._heads(base, region, service, upload_id)
        head = heads(part_number, len(body), checksum)
        return self._result(*await self.transport.send(base, head, body))

    async def put_object(
        self, bucket: str, key: str, body: memoryview, headers: dict[str, str]
    ) -> dict[str, Any]:
        """One try of PutObject with ``headers`` (as :func:`put_headers` makes them); the
        answer's ``ETag`` (and checksum) as the client's ``put_object`` returns them.
        Errors are the client's ``ClientError`` s; :class:`Redirected` where the client
        must send it (nothing was stored)."""
        url, region, service = await self.addresses.derived(bucket, key)
        credentials = await signing_credentials(self.client)
        signed = self.signer.sign(
            url, headers, credentials=credentials, region=region, service=service
        )
        head = request_head("PUT", url, signed, len(body))
        status, answer, content = await self.transport.send(url, head, body)
        if 300 <= status < 400:
            raise Redirected(f"PutObject redirected ({status})")
        return self._result(status, answer, content, operation="PutObject")

    async def try_parts(
        self,
        bucket: str,
        key: str,
        upload_id: str,
        parts: list[tuple[int, memoryview, str | None]],
        connections: int,
    ) -> list[dict[str, Any] | Exception] | None:
        """One try of each ``(part number, body, checksum)``, the whole batch sent by native
        threads (:mod:`~.batch`) on at most ``connections`` connections: for each, what
        :meth:`upload_part` would return, or the error it would raise (a
        :class:`~.batch.NotSent` for a part left to the usual path). None where batches
        cannot go that way (HTTPS, the sender not built): send each part instead."""
        if self.batch is None:
            return None
        base, region, service = await self.addresses.presigned(bucket, key)
        if base.scheme != "http":
            return None
        heads = await self._heads(base, region, service, upload_id)
        requests = [(heads(number, len(body), checksum), body) for number, body, checksum in parts]
        answers = await self.batch.send(base, requests, connections)
        return [self._outcome(answer) for answer in answers]

    async def _heads(
        self, base: SplitResult, region: str, service: str, upload_id: str
    ) -> PartHeads:
        """Signed heads for the parts of upload ``upload_id`` of the object at ``base``
        (its URL, signing region and service), the credentials looked up
        once for all of them."""
        credentials = await signing_credentials(self.client)
        return PartHeads(
            self.signer, base, upload_id, credentials=credentials, region=region,
            service=service, host_header=host_header(base), user_agent=_USER_AGENT,
        )  # fmt: skip

    def _result(
        self,
        status: int,
        answer: dict[str, str],
        content: bytes,
        operation: str = "UploadPart",
    ) -> dict[str, Any]:
        """An UploadPart or PutObject answer as the client returns it, or raises it."""
        if status >= 300:
            raise client_error(self.client, operation, status, answer, content)
        result = {"ETag": answer.get("etag", "")}
        if "x-amz-checksum-crc32c" in answer:
            result["ChecksumCRC32C"] = answer["x-amz-checksum-crc32c"]
        return result

    def _outcome(self, answer: Answer | Exception) -> dict[str, Any] | Exception:
        if isinstance(answer, Exception):
            return answer
        try:
            return self._result(*answer)
        except Exception as exc:  # the ClientError the try ends with
            return exc


async def signing_credentials(client: Any) -> Any:
    """The credentials ``client`` signs with now; the client's own error where it has none."""
    credentials = await frozen_credentials(client)
    if credentials is None:
        raise no_credentials()
    return credentials


def put_headers(params: dict[str, Any]) -> dict[str, str] | None:
    """The headers of a PutObject with ``params`` (as the client takes them), or None
    where a parameter is one the data plane does not send (the client sends it then)."""
    headers: dict[str, str] = {}
    for name, value in params.items():
        header = _PUT_HEADERS.get(name)
        if header is None:
            if name not in ("Key", "Body"):
                return None
        else:
            headers[header] = str(value)
    return headers


class BodySender:
    """The ``before-send`` handler that sends the bodies of the PutObjects the client sends
    (parameters :func:`put_headers` does not take) on the pool's connections. The parts
    the client sends (after a redirect) go through aiohttp, as its other requests do."""

    OPERATIONS = ("PutObject",)

    def __init__(self, transport: BodyTransport) -> None:
        self.transport = transport

    def register(self, client: Any) -> None:
        for operation in self.OPERATIONS:
            on_before_send(client, operation, self)

    async def __call__(self, request: Any, **_: Any) -> Response | None:
        body = memory_of(request.body)
        url = urlsplit(request.url)
        if body is None or url.scheme not in _DEFAULT_PORTS or not url.hostname:
            return None  # aiohttp sends it
        head = request_head(request.method, url, request.headers, len(body))
        status, headers, content = await self.transport.send(url, head, body)
        return response(request.url, status, headers, content)


def memory_of(body: Any) -> memoryview | None:
    """The request body as one flat ``memoryview``, or None for bodies of other kinds."""
    if isinstance(body, (bytes, bytearray, memoryview)):
        view = memoryview(body)
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    return None


def request_head(method: str, url: Any, headers: Any, length: int) -> bytes:
    """The request line and ``headers`` (a mapping) as signed, with ``Host`` and
    ``Content-Length`` (which a GET or HEAD without a body goes without, as aiohttp sends
    them)."""
    host = host_header(url)
    target = f"{url.path or '/'}?{url.query}" if url.query else url.path or "/"
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    if length or method not in _BODILESS:
        lines.append(f"Content-Length: {length}")
    agent = False
    for name, value in headers.items():
        lower = name.lower()
        if lower in _OWN_HEADERS:
            continue
        agent = agent or lower == "user-agent"
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        lines.append(f"{name}: {text}")
    if not agent:
        lines.append(f"User-Agent: {_USER_AGENT}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def host_header(url: Any) -> str:
    """The ``Host`` header's value: SigV4 signs the host without the scheme's default port,
    as aiohttp sends it."""
    default = f":{_DEFAULT_PORTS.get(url.scheme, 0)}"
    return url.netloc[: -len(default)] if url.netloc.endswith(default) else url.netloc
