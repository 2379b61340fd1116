"""The aiobotocore S3 client: configured for speed, created lazily, one per loop and config.

The client is configured the way a fast client should talk to FlashBlade: path-style by
default, no SHA-256 payload signing (``UNSIGNED-PAYLOAD``), no checksums computed by
botocore (callers send a CRC32C computed natively), no botocore retries (:mod:`s3ckpt.s3.retry`
is the one retry layer), and no parameter validation (it rejects the ``memoryview``
bodies that carry tensor bytes without a copy).

Clients live in the resources of the process's I/O loop (:mod:`s3ckpt.s3.loop`), keyed by the
configuration: every store with the same settings shares one connection pool and one
request bound, and a forked child, which gets a new loop, creates its own.

Each client's transport (:mod:`s3ckpt.s3.transport`) is chosen once, as the client is
made: unless the endpoint is reached through a proxy, the data plane
(:class:`~s3ckpt.s3.wire.DataPlane`: upload bodies, ranged GETs and a save's requests,
over HTTP and HTTPS, on its own connections; :mod:`s3ckpt.s3.wire` says why), else the
client alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession

from s3ckpt.config import S3Config, client_environment
from s3ckpt.errors import ConfigError
from s3ckpt.s3.compat_botocore import note_endpoints, on_before_sign
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.retry import StoreAnswers
from s3ckpt.s3.transport import Transport, choose_transport
from s3ckpt.s3.wire.data_plane import content_md5

log = logging.getLogger(__name__)


class ClientHandle:
    """An entered aiobotocore client, the semaphore bounding its requests, and the
    transport its requests go through (:mod:`s3ckpt.s3.transport`), chosen as it is made."""

    def __init__(self, config: S3Config, environment: tuple[str | None, ...] = ()) -> None:
        self.config = config
        self.environment = environment  # the AWS variables the client was created under
        self.client: Any = None
        self.slots = asyncio.Semaphore(config.max_concurrency)
        self._taking_slots = asyncio.Lock()  # see slots_for
        self._ctx: Any = None
        self._lock = asyncio.Lock()
        self._transport: Transport | None = None
        # Whether the endpoint has answered a request of this process: until it has, a
        # connection it refuses is more likely a wrong endpoint than a blip (retry.py).
        self.answered = False
        self.answers = StoreAnswers()  # when it last answered (stalls: retry.py)

    async def get(self) -> Any:
        if self.client is None:
            async with self._lock:
                if self.client is None:
                    self._ctx = create_client(self.config)
                    try:
                        client = await self._ctx.__aenter__()
                    except ValueError as exc:  # botocore's "Invalid endpoint: ..."
                        raise ConfigError(
                            f"no S3 client can be made: {exc} (check --endpoint-url, "
                            "AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3 and the AWS config file)"
                        ) from exc
                    on_before_sign(client, "DeleteObjects", add_content_md5)
                    note_endpoints(client)  # errors name the endpoint that answered
                    self._transport = choose_transport(client, self.config, tls_verify(self.config))
                    self.client = client
        return self.client

    async def transport(self) -> Transport:
        """The client's transport, the client made first where it is not yet."""
        await self.get()
        assert self._transport is not None  # made with the client
        return self._transport

    @contextlib.asynccontextmanager
    async def slots_for(self, count: int) -> AsyncIterator[None]:
        """Hold ``count`` request slots (a batch of parts on ``count`` connections). One
        holder at a time takes several, so that no two wait for more while each holds
        some of them."""
        taken = 0
        try:
            async with self._taking_slots:
                for _ in range(count):
                    await self.slots.acquire()
                    taken += 1
            yield
        finally:
            for _ in range(taken):
                self.slots.release()

    def close_idle(self) -> None:
        """Close the transport's kept-alive connections, so the next requests open new ones."""
        if self._transport is not None:
            self._transport.close_idle()

    async def aclose(self) -> None:
        if self._transport is not None:
            await self._transport.aclose()
            self._transport = None
        if self._ctx is not None:
            await self._ctx.__aexit__(None, None, None)
            self._ctx = self.client = None


def add_content_md5(request: Any, **_: Any) -> None:
    """:func:`~s3ckpt.s3.wire.data_plane.content_md5` on the DeleteObjects the client sends."""
    body = request.body or b""
    if isinstance(body, str):
        body = body.encode()
    if isinstance(body, (bytes, bytearray)) and "Content-MD5" not in request.headers:
        request.headers["Content-MD5"] = content_md5(bytes(body))


def create_client(config: S3Config) -> Any:
    session = AioSession(profile=config.profile) if config.profile else AioSession()
    aio_config = AioConfig(
        signature_version="s3v4",
        s3={"addressing_style": config.addressing_style, "payload_signing_enabled": False},
        max_pool_connections=config.max_concurrency,
        connect_timeout=config.connect_timeout,
        read_timeout=config.idle_timeout(),  # stalls: S3Config.stall_timeout_s
        retries={"total_max_attempts": 1},  # s3ckpt.s3.retry is the one retry layer
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        tcp_keepalive=True,
        proxies=config.proxies,
        # Validation rejects memoryview bodies, which is how tensor bytes are sent without a
        # copy; every request's parameters are built by this module.
        parameter_validation=False,
    )
    return session.create_client(
        "s3",
        endpoint_url=config.endpoint_url,
        region_name=config.region,
        aws_access_key_id=config.access_key_id,
        aws_secret_access_key=config.secret_access_key,
        aws_session_token=config.session_token,
        verify=config.verify,
        config=aio_config,
    )


def tls_verify(config: S3Config) -> bool | str:
    """What the data plane verifies TLS with: what aiobotocore uses for the same config
    (botocore resolves ``verify=None`` through the AWS chain the same way)."""
    if config.verify is not None:
        return config.verify
    session = AioSession(profile=config.profile) if config.profile else AioSession()
    return session.get_config_variable("ca_bundle") or True


def client_handle(config: S3Config) -> ClientHandle:
    """The calling process's client for ``config`` (call on the I/O loop).

    When the AWS environment changed since the client was made (rotated credentials), a
    new client takes its place and the old one is closed once the requests it may still
    be serving are over, so rotations do not pile up connection pools.
    """
    resources = io_loop().resources
    key = ("s3-client", config.client_key())
    environment = client_environment()
    handle = resources.get(key)
    if handle is not None and handle.environment != environment:
        _retire(handle)
        handle = None
    if handle is None:
        handle = resources[key] = ClientHandle(config, environment)
    return handle


def prepare_client(config: S3Config) -> None:
    """Start making this process's client for ``config`` on the I/O loop, without waiting
    for it: the first request then finds it made. Making one is the first request's
    largest cost (aiobotocore loads and parses the S3 service model), which a restart's
    first listing would otherwise pay before anything else. A failure is left for that
    first request to meet and report (a failed attempt leaves no client behind)."""

    async def make() -> None:
        try:
            await client_handle(config).get()
        except Exception:
            log.debug("the S3 client could not be made ahead of its first request", exc_info=True)

    io_loop().submit(make(), scoped=False)


def _retire(handle: ClientHandle) -> None:
    """Close a replaced client later: its requests in flight get ``read_timeout`` twice
    over (a request silent for longer fails anyway) to finish."""
    delay = (
        RETIRE_AFTER_READ_TIMEOUTS * handle.config.idle_timeout() + handle.config.connect_timeout
    )
    loop = asyncio.get_running_loop()
    loop.call_later(delay, lambda: loop.create_task(handle.aclose()))


RETIRE_AFTER_READ_TIMEOUTS = 2
