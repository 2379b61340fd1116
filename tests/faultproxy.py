"""A fault-injecting HTTP proxy on 127.0.0.1, between an S3 client and a real S3 server.

Mocks cannot show that retries work: the faults have to happen on a real socket, in the
middle of real bodies, so that aiohttp, botocore and s3ckpt each see what they would see
in production. The proxy relays every request untouched unless a :class:`Rule` picks it,
and then injects one of:

========================  ===================================================================
``slowdown``              answer ``503 SlowDown`` (S3's throttling error) without forwarding
``reset_request``         forward ``after`` bytes of the request body, then reset both sides
``reset_response``        forward ``after`` bytes of the response body, then reset the client
``stall``                 forward ``after`` bytes of the response body, then go silent
``truncate``              forward ``after`` bytes of the response body, then close cleanly
``corrupt``               flip one bit of response body byte ``after`` (2xx GETs only)
``delay``                 hold the request for a random 0 to ``delay_s`` seconds, then relay it
``not_implemented``       answer ``501 NotImplemented`` without forwarding (a missing feature)
``chunked_error``         answer ``503 SlowDown`` with a chunked body, as AWS sends its errors
``redirect``              answer ``307 Temporary Redirect`` to the same URL, without forwarding
========================  ===================================================================

``ignore_range=True`` strips ``Range`` from requests: a server that answers ranged GETs
with the whole object. ``conditional="reject"`` answers every request carrying
``If-None-Match`` or ``If-Match``
with 501 (a store without conditional writes that says so), ``"ignore"`` strips those
headers before relaying (a store that silently ignores them, as some do). The headers are
covered by the request's SigV4 signature, so a server that checks signatures (SeaweedFS)
refuses a request they were stripped from: given the server's ``secret_key``, the proxy
signs such a request again without them.

``after=-1`` acts before the response head (the server did the work, the client never
learns). Each connection carries one request (``Connection: close`` is forced), which keeps
the relay a plain byte pump. Decisions come from ``random.Random(seed)``, so the same
sequence of requests meets the same faults, and ``per_request`` caps how often one request
(method and target) is hit, by all rules together, which is what makes a fault transient:
a request retried more often than that gets through. ``limit`` caps how many requests a
rule is given to at once or has fired on. A ranged GET whose body is too short to reach
``after`` is never given a rule that acts there, and a request given a rule it could not
fire on (an unranged response shorter than ``after``, a failed GET, for ``corrupt``) gives
it back: which of several concurrent requests comes first cannot use a limit up. ``counts`` tallies
every fault that fired; ``requests`` every request seen, by method; ``body_bytes`` the
response bytes relayed after the heads, by method (what GETs cost the store).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import random
import socket
import ssl
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlparse

Fault = Literal[
    "slowdown",
    "reset_request",
    "reset_response",
    "stall",
    "truncate",
    "corrupt",
    "delay",
    "not_implemented",
    "chunked_error",
    "redirect",
]
Conditional = Literal["pass", "reject", "ignore"]
_SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>faultproxy</RequestId></Error>"
)
_SLOWDOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(_SLOWDOWN_BODY) + _SLOWDOWN_BODY
)
_NOT_IMPLEMENTED_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NotImplemented</Code>'
    b"<Message>A header you provided implies functionality that is not implemented."
    b"</Message><RequestId>faultproxy</RequestId></Error>"
)
_NOT_IMPLEMENTED = (
    b"HTTP/1.1 501 Not Implemented\r\nContent-Type: application/xml\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n"
    % len(_NOT_IMPLEMENTED_BODY)
    + _NOT_IMPLEMENTED_BODY
)
_CHUNKED_SLOWDOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nTransfer-Encoding: chunked\r\n"
    b"Connection: close\r\n\r\n"
    + b"".join(
        b"%x\r\n%s\r\n" % (len(piece), piece)
        for piece in (_SLOWDOWN_BODY[:40], _SLOWDOWN_BODY[40:])
    )
    + b"0\r\n\r\n"
)
_CONDITIONAL = (b"if-none-match:", b"if-match:")
# The faults that act at byte ``after`` of the response body (``after=-1``: before its head).
_AT_BODY_OFFSET = frozenset({"reset_response", "stall", "truncate", "corrupt"})


@dataclass(eq=False)
class Rule:
    """Which requests get which fault (``methods`` empty: any; ``match``: target substring)."""

    fault: Fault
    rate: float = 1.0
    methods: tuple[str, ...] = ()
    match: str = ""
    after: int = 0
    limit: int | None = None
    per_request: int | None = 2
    chosen: int = field(default=0, init=False)  # what ``limit`` counts: picks not given back

    def wants(self, method: str, target: str) -> bool:
        return (
            (not self.methods or method in self.methods)
            and self.match in target
            and (self.limit is None or self.chosen < self.limit)
        )


@dataclass
class _Exchange:
    """One request on its way through: what it is and the fault it was given."""

    method: str
    target: str
    rule: Rule | None
    fired: bool = False


class FaultProxy:
    """Relays to ``upstream`` (``http://host:port``); a context manager, one thread."""

    def __init__(
        self,
        upstream: str,
        *,
        seed: int = 0,
        stall_s: float = 10.0,
        delay_s: float = 1.0,
        conditional: Conditional = "pass",
        ignore_range: bool = False,
        tls: ssl.SSLContext | None = None,
        secret_key: str | None = None,
    ) -> None:
        parsed = urlparse(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.rules: list[Rule] = []
        self.counts: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.body_bytes: Counter[str] = Counter()  # response body bytes relayed, by method
        self.stall_s = stall_s
        self.delay_s = delay_s
        self.conditional = conditional
        self.ignore_range = ignore_range
        self._secret_key = secret_key
        self._tls = tls
        self._rng = random.Random(seed)
        self._hits: Counter[tuple[str, str]] = Counter()  # faults per (method, target)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"{'https' if self._tls else 'http'}://127.0.0.1:{self.port}"

    def add(self, *rules: Rule) -> FaultProxy:
        self.rules.extend(rules)
        return self

    def clear(self) -> None:
        """Back to a plain relay (counts are kept)."""
        self.rules = []

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        start = asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self._tls)
        self._server = asyncio.run_coroutine_threadsafe(start, self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- one connection, one request ---------------------------------------------------

    async def _serve(self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._exchange(client, to_client)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # a side hung up or was reset: nothing left to relay
        finally:
            self._tasks.discard(task)
            with contextlib.suppress(Exception):
                to_client.close()

    async def _exchange(
        self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter
    ) -> None:
        head = await client.readuntil(b"\r\n\r\n")
        method, target, headers = _parse_head(head)
        self.requests[method] += 1
        body = None if self.ignore_range else _range_length(headers.get("range", ""))
        exchange = _Exchange(method, target, self._choose(method, target, body))
        try:
            await self._relay(client, to_client, exchange, head, headers)
        finally:
            if exchange.rule is not None and not exchange.fired:
                exchange.rule.chosen -= 1  # given back: it never fired on this request

    async def _relay(
        self,
        client: asyncio.StreamReader,
        to_client: asyncio.StreamWriter,
        exchange: _Exchange,
        head: bytes,
        headers: dict[str, str],
    ) -> None:
        target = exchange.target
        refused = self.conditional == "reject" and any(
            h in headers for h in ("if-none-match", "if-match")
        )
        fault = exchange.rule.fault if exchange.rule is not None else None
        answers = {
            "slowdown": _SLOWDOWN,
            "not_implemented": _NOT_IMPLEMENTED,
            "chunked_error": _CHUNKED_SLOWDOWN,
            "redirect": _redirect(headers.get("host", ""), target),
        }
        if refused or fault in answers:
            if headers.get("expect", "").lower() != "100-continue":
                await client.readexactly(int(headers.get("content-length", "0")))
            if fault in answers:
                self._fire(exchange)
            if refused:
                self.counts["conditional_refused"] += 1
            to_client.write(answers.get(fault, _NOT_IMPLEMENTED))
            await to_client.drain()
            return
        if fault == "delay":
            self._fire(exchange)
            await asyncio.sleep(self._rng.uniform(0, self.delay_s))
        if self.conditional == "ignore" and any(
            h in headers for h in ("if-none-match", "if-match")
        ):
            head = _without(head, _CONDITIONAL)
            if self._secret_key is not None:
                head = _signed_again(head, self._secret_key)
                self.counts["conditional_ignored"] += 1
        if self.ignore_range:
            head = _without(head, (b"range:",))
        server, to_server = await asyncio.open_connection(*self.upstream)
        try:
            to_server.write(_close_after(head))
            sending = asyncio.ensure_future(self._send(client, to_server, to_client, exchange))
            try:
                await self._receive(server, to_client, exchange)
            finally:
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
        finally:
            to_server.close()

    async def _send(
        self,
        client: asyncio.StreamReader,
        to_server: asyncio.StreamWriter,
        to_client: asyncio.StreamWriter,
        exchange: _Exchange,
    ) -> None:
        """Pump the request body; ``reset_request`` cuts it after ``after`` bytes."""
        rule, sent = exchange.rule, 0
        while chunk := await client.read(65536):
            if (
                rule is not None
                and rule.fault == "reset_request"
                and sent + len(chunk) > rule.after
            ):
                to_server.write(chunk[: max(rule.after - sent, 0)])
                self._fire(exchange)
                _reset(to_client)
                to_server.transport.abort()
                return
            to_server.write(chunk)
            await to_server.drain()
            sent += len(chunk)

    async def _receive(
        self, server: asyncio.StreamReader, to_client: asyncio.StreamWriter, exchange: _Exchange
    ) -> None:
        """Pump the response, applying a response-side fault at its body offset."""
        request_side = ("reset_request", "delay")
        rule = exchange.rule if exchange.rule and exchange.rule.fault not in request_side else None
        while True:  # interim 1xx responses (100 Continue) go through as they are
            head = await server.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            if not 100 <= status < 200:
                break
            to_client.write(head)
        if rule is not None and rule.after < 0:
            return await self._inject(exchange, to_client)
        to_client.write(head)
        if (
            rule is not None
            and rule.fault == "corrupt"
            and not (exchange.method == "GET" and status < 300)
        ):
            rule = None
        received = 0
        while chunk := await server.read(65536):
            if rule is not None and received + len(chunk) > rule.after:
                at = rule.after - received
                if rule.fault == "corrupt":
                    chunk = chunk[:at] + bytes([chunk[at] ^ 0x01]) + chunk[at + 1 :]
                    self._fire(exchange)
                    rule = None
                else:
                    to_client.write(chunk[:at])
                    return await self._inject(exchange, to_client)
            to_client.write(chunk)
            await to_client.drain()
            received += len(chunk)
            self.body_bytes[exchange.method] += len(chunk)

    async def _inject(self, exchange: _Exchange, to_client: asyncio.StreamWriter) -> None:
        """The response-side faults that end the exchange."""
        assert exchange.rule is not None
        self._fire(exchange)
        fault = exchange.rule.fault
        if fault == "reset_response":
            _reset(to_client)
            return
        await to_client.drain()
        if fault == "stall":
            await asyncio.sleep(self.stall_s)

    # -- decisions ---------------------------------------------------------------------

    def _choose(self, method: str, target: str, body: int | None) -> Rule | None:
        """The rule for this request, if any; ``body``: the length of the response body
        its ``Range`` asks for, where it has one."""
        for rule in self.rules:
            if not rule.wants(method, target):
                continue
            if rule.fault in _AT_BODY_OFFSET and body is not None and 0 <= body <= rule.after:
                continue  # the fault acts after byte ``after``: a body this short never gets there
            cap = rule.per_request
            if cap is not None and self._hits[(method, target)] >= cap:
                continue
            if self._rng.random() < rule.rate:
                rule.chosen += 1
                return rule
        return None

    def _fire(self, exchange: _Exchange) -> None:
        rule = exchange.rule
        assert rule is not None
        exchange.fired = True
        self.counts[rule.fault] += 1
        self._hits[(exchange.method, exchange.target)] += 1


def _range_length(value: str) -> int | None:
    """The number of bytes a ``Range: bytes=first-last`` header asks for; None for none."""
    first, dash, last = value.strip().removeprefix("bytes=").partition("-")
    if not (value.strip().startswith("bytes=") and dash and first.isdigit() and last.isdigit()):
        return None
    return int(last) - int(first) + 1


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return method, target, headers


def _redirect(host: str, target: str) -> bytes:
    body = (
        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>TemporaryRedirect</Code>'
        b"<Message>Please re-send this request to the specified temporary endpoint.</Message>"
        b"</Error>"
    )
    return (
        b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://%s%s\r\n"
        b"Content-Type: application/xml\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
        % (host.encode(), target.encode(), len(body))
        + body
    )


def _without(head: bytes, names: tuple[bytes, ...]) -> bytes:
    """The request head without the headers ``names`` (lower case, with the colon)."""
    lines = head.rstrip(b"\r\n").split(b"\r\n")
    kept = [line for line in lines if not line.lower().startswith(names)]
    return b"\r\n".join(kept) + b"\r\n\r\n"


def _signed_again(head: bytes, secret_key: str) -> bytes:
    """``head`` with its SigV4 ``Authorization`` computed anew over the headers it still has
    (the signature of a request whose signed headers were stripped), with the same date,
    scope and payload hash. A head not signed with SigV4 is returned as it is."""
    lines = head.rstrip(b"\r\n").decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    authorization = headers.get("authorization", "")
    if not authorization.startswith("AWS4-HMAC-SHA256 "):
        return head
    fields = dict(part.strip().split("=", 1) for part in authorization.split(" ", 1)[1].split(","))
    signed = [h for h in fields["SignedHeaders"].split(";") if h in headers]
    path, _, query = target.partition("?")
    pairs = sorted(pair.partition("=")[::2] for pair in query.split("&") if pair)
    canonical = "\n".join(
        [
            method,
            path,
            "&".join(f"{key}={value}" for key, value in pairs),
            "".join(f"{h}:{' '.join(headers[h].split())}\n" for h in signed),
            ";".join(signed),
            headers.get("x-amz-content-sha256", "UNSIGNED-PAYLOAD"),
        ]
    )
    scope = fields["Credential"].split("/", 1)[1]
    to_sign = "\n".join(
        [
            "AWS4-HMAC-SHA256",
            headers["x-amz-date"],
            scope,
            hashlib.sha256(canonical.encode()).hexdigest(),
        ]
    )
    key = ("AWS4" + secret_key).encode()
    for part in scope.split("/"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    authorization = (
        f"AWS4-HMAC-SHA256 Credential={fields['Credential']}, "
        f"SignedHeaders={';'.join(signed)}, Signature={signature}"
    )
    kept = [
        f"Authorization: {authorization}" if line.lower().startswith("authorization:") else line
        for line in lines
    ]
    return ("\r\n".join(kept) + "\r\n\r\n").encode("latin-1")


def _close_after(head: bytes) -> bytes:
    """The request head with ``Connection: close``: one request per connection."""
    lines = [
        line
        for line in head.rstrip(b"\r\n").split(b"\r\n")
        if not line.lower().startswith((b"connection:", b"keep-alive:"))
    ]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n"


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a crashed peer or middlebox would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
