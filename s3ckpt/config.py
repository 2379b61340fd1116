"""Connection and tuning settings: one frozen, validated dataclass, plus ``s3://`` URI parsing.

Anything left as ``None`` falls through to the standard AWS chain (environment variables
such as ``AWS_ENDPOINT_URL`` and ``AWS_ACCESS_KEY_ID``, the shared config and credentials
files, the selected profile), so a job configured for the AWS CLI works unchanged and
keyword arguments only override. The config pickles (process-mode ``async_save`` ships the
writer to a child process) and never prints its secrets.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlparse

from s3ckpt.errors import ConfigError, InvalidURIError

MiB = 1024 * 1024
GiB = 1024 * MiB
_CLIENT_ENVIRONMENT = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_CA_BUNDLE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
)


@dataclass(frozen=True)
class S3Config:
    """How to reach the object store and how hard to drive it.

    Connection:
        endpoint_url: e.g. ``https://flashblade.example.com``; ``None`` lets botocore
            resolve it as the AWS CLI does: ``AWS_ENDPOINT_URL_S3``, else
            ``AWS_ENDPOINT_URL``, else the AWS config file's ``endpoint_url`` for ``s3`` in
            the services section the profile names, else the profile's own
            ``endpoint_url``, else AWS itself. ``s3ckpt doctor`` reports which one
            requests use (:func:`s3ckpt.catalog.doctor.endpoint_source`).
        region, profile: as in the AWS CLI.
        access_key_id, secret_access_key, session_token: explicit credentials (hidden from repr).
        addressing_style: ``"path"`` (FlashBlade's default), ``"virtual"`` or ``"auto"``.
        verify: ``None`` (default) verifies TLS against the standard AWS chain's CA bundle:
            ``AWS_CA_BUNDLE``, else ``ca_bundle`` in the AWS config file, else botocore's
            default bundle (certifi's Mozilla CAs, not the operating system's store); a
            path verifies against that bundle (a private CA); ``True`` uses botocore's
            default bundle whatever the environment; ``False`` skips verification (not
            recommended).
        proxies: ``{"http": url, "https": url}``, as botocore takes them; by default the
            ``HTTP_PROXY``/``HTTPS_PROXY``/``NO_PROXY`` environment applies.
    Transfers:
        part_size: multipart part size in bytes; ``None`` picks one per object within S3's limits.
        max_concurrency: concurrent requests per process, across all transfers.
        max_bytes_in_flight: bytes handed to the transfer engine but not yet acknowledged.
        checksums: send a CRC32C with every upload so the server rejects corrupted parts.
        conditional_commit: commit manifests with ``If-None-Match: *``; ``None`` probes once
            per endpoint and bucket, ``False`` uses the claim protocol, correct on stores
            without conditional writes (``docs/format.md``).
        connect_timeout, read_timeout: seconds; a connection that stalls for longer than
            ``read_timeout`` counts as failed and is retried (within ``stall_timeout_s``).
        stall_timeout_s: how long a request may make no progress at all before its save
            (or load) fails with :class:`~s3ckpt.errors.StoreStalledError` instead of
            retrying until ``deadline_s``: each try of a request is stopped after
            ``stall_timeout_s / 2`` (or ``read_timeout``, where shorter) without a byte
            sent or received, and is tried again on a fresh connection; once consecutive
            stopped tries of one request add up to ``stall_timeout_s`` of silence, the
            store counts as stalled (a store that filled up may hang instead of
            answering). Only silence counts: a slow link that keeps moving bytes never
            trips it, however long a part takes. Default 60 s; ``None``: no stall limit,
            stalled tries are retried until the deadline.
        direct_reads: receive ranged GETs of checkpoint data with s3ckpt's own transport,
            straight into the destination memory (:mod:`s3ckpt.s3.wire`); ``False`` sends
            them through aiobotocore like every other request.
        direct_uploads: send upload bodies (parts and PUTs) from memory with s3ckpt's own
            transport, over HTTP and HTTPS (:mod:`s3ckpt.s3.wire`), and HEADs with it;
            ``False`` leaves them to aiohttp. Same signing and verification either way.
            Endpoints reached through a proxy (``proxies`` or the environment) always use
            aiobotocore for both.
        native_uploads: with ``direct_uploads``, send batches of parts to plain-HTTP
            endpoints from native threads that never take the GIL
            (:mod:`s3ckpt.s3.wire.batch`), so that a thread-mode save costs the training
            loop less; ``False`` sends each part from the event loop. Same requests, same
            retries either way; HTTPS endpoints always send each part.
        tls_threads: deprecated name of ``direct_uploads`` (set, it wins, with a warning).
    Retries:
        deadline_s: time budget of one save's (or load's) requests, all phases together:
            failures a retry can fix (throttling, 5xx, dropped connections, timeouts) are
            retried (:mod:`s3ckpt.s3.retry`), with exponential backoff and full jitter, until
            it is spent; then the save ends with :class:`~s3ckpt.errors.DeadlineExceededError`. Anything else
            fails at the first try. ``None`` (set in an ``S3Config``: a keyword argument of
            ``None`` means "not given"): no budget; then at most 10 tries per request.
        max_attempts: a cap on tries per request on top of the deadline (``None``, the
            default: none; the CLI's short commands use 3).
        retry_base_delay_s: the backoff's base, in seconds: the wait before a request's
            ``n``-th retry is drawn uniformly from ``[0, retry_base_delay_s * 2**(n - 1)]``
            (capped at 20 s), as botocore's standard retry mode draws it. Default 0.25 s;
            a store on the same host or rack can take a shorter one.
    """

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    addressing_style: Literal["path", "virtual", "auto"] = "path"
    verify: bool | str | None = None
    proxies: dict[str, str] | None = None
    part_size: int | None = None
    max_concurrency: int = 16
    max_bytes_in_flight: int = 1 * GiB
    checksums: bool = True
    conditional_commit: bool | None = None
    connect_timeout: float = 10.0
    read_timeout: float = 120.0
    direct_reads: bool = True
    direct_uploads: bool = True
    native_uploads: bool = True
    tls_threads: bool | None = None
    max_attempts: int | None = None
    deadline_s: float | None = 900.0
    stall_timeout_s: float | None = 60.0
    retry_base_delay_s: float = 0.25

    def __post_init__(self) -> None:
        if self.endpoint_url is not None:
            _check_endpoint(self.endpoint_url)
        if isinstance(self.verify, str) and not os.path.isfile(self.verify):
            raise ConfigError(f"verify: no CA bundle file at {self.verify!r}")
        if self.addressing_style not in ("path", "virtual", "auto"):
            raise ConfigError(
                f"addressing_style must be path, virtual or auto, got {self.addressing_style!r}"
            )
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError("access_key_id and secret_access_key must be given together")
        if self.part_size is not None and not (5 * MiB <= self.part_size <= 5 * GiB):
            raise ConfigError(f"part_size must be between 5 MiB and 5 GiB, got {self.part_size}")
        if self.max_concurrency < 1:
            raise ConfigError("max_concurrency must be at least 1")
        if self.max_bytes_in_flight < 5 * MiB:
            raise ConfigError("max_bytes_in_flight must be at least 5 MiB")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ConfigError("max_attempts must be at least 1")
        if self.connect_timeout <= 0 or self.read_timeout <= 0:
            raise ConfigError("timeouts must be positive")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ConfigError(f"deadline_s must be positive or None, got {self.deadline_s}")
        if not self.retry_base_delay_s > 0:
            raise ConfigError(f"retry_base_delay_s must be positive, got {self.retry_base_delay_s}")
        if self.stall_timeout_s is not None and not self.stall_timeout_s > 0:
            raise ConfigError(
                f"stall_timeout_s must be positive or None, got {self.stall_timeout_s}"
            )
        if self.tls_threads is not None:
            warnings.warn(
                "S3Config(tls_threads=...) is deprecated: use direct_uploads, which also "
                "covers plain HTTP",
                DeprecationWarning,
                stacklevel=3,
            )

    def uploads_on_data_plane(self) -> bool:
        """Whether upload bodies go through s3ckpt's transport (``direct_uploads``, or the
        deprecated ``tls_threads`` where it is set)."""
        return self.direct_uploads if self.tls_threads is None else self.tls_threads

    def idle_timeout(self) -> float:
        """Seconds one try of a request may go without moving a byte before it is stopped
        (and retried): ``read_timeout``, or half of ``stall_timeout_s`` where that is
        shorter, so that two silent tries make a stall."""
        if self.stall_timeout_s is None:
            return self.read_timeout
        return min(self.read_timeout, self.stall_timeout_s / 2)

    def replace(self, **changes: object) -> S3Config:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def client_key(self) -> tuple[object, ...]:
        """What decides which client is used: equal keys share one client."""
        return (
            self.endpoint_url,
            self.region,
            self.profile,
            self.access_key_id,
            self.secret_access_key,
            self.session_token,
            self.addressing_style,
            self.verify,
            tuple(sorted((self.proxies or {}).items())),
            self.max_concurrency,
            self.connect_timeout,
            self.idle_timeout(),
            self.direct_reads,
            self.uploads_on_data_plane(),
            self.native_uploads,
        )


def _check_endpoint(url: str) -> None:
    """``https://host[:port]``, and no credentials in it (they would end up in logs)."""
    try:
        parsed = urlparse(url)
        parsed.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        raise ConfigError(f"endpoint_url is not a valid URL ({exc})") from None
    if parsed.username is not None or parsed.password is not None:
        raise ConfigError(
            "endpoint_url must not carry credentials (user:password@); pass them as "
            "access_key_id/secret_access_key or through the AWS environment"
        )
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"endpoint_url must look like https://host[:port], got {url!r}")


def client_environment() -> tuple[str | None, ...]:
    """The AWS environment variables a client reads when it is created: a process that
    changes them (a rotated ``AWS_SESSION_TOKEN``) needs a new client, not a stale one."""
    return tuple(os.environ.get(name) for name in _CLIENT_ENVIRONMENT)


def make_config(config: S3Config | None, **overrides: object) -> S3Config:
    """Merge keyword overrides (those not ``None``) into ``config`` or the defaults."""
    base = config or S3Config()
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(given) - {f.name for f in dataclasses.fields(S3Config)}
    if unknown:
        raise ConfigError(f"unknown option(s): {', '.join(sorted(unknown))}")
    return base.replace(**given) if given else base


@dataclass(frozen=True)
class S3URI:
    """A parsed ``s3://bucket/prefix`` location; ``prefix`` has no leading or trailing slash."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: object, *, require_prefix: bool = True) -> S3URI:
        text = str(uri) if uri is not None else ""
        if not text.startswith("s3://"):
            raise InvalidURIError(f"expected an s3://bucket/prefix URI, got {text!r}")
        bucket, _, prefix = text[len("s3://") :].partition("/")
        prefix = prefix.strip("/")
        if not _valid_bucket(bucket):
            raise InvalidURIError(f"invalid bucket name {bucket!r} in {text!r}")
        if require_prefix and not prefix:
            raise InvalidURIError(
                f"{text!r} names a bucket only; a checkpoint needs a prefix, e.g. s3://{bucket}/run1/step-100"
            )
        if "//" in prefix:
            raise InvalidURIError(f"empty path segment in {text!r}")
        return cls(bucket, prefix)

    def key(self, name: str) -> str:
        """The object key of ``name`` inside this location."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def child(self, name: str) -> S3URI:
        return S3URI(self.bucket, self.key(name.strip("/")))

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


MAX_KEY_BYTES = 1024  # S3's limit on an object key, in bytes of UTF-8


def check_key_room(location: S3URI, longest: str, what: str) -> None:
    """Refuse ``location`` (with :class:`~s3ckpt.errors.InvalidURIError`) when ``longest``,
    the longest name written under it, would make a key longer than S3 takes
    (:data:`MAX_KEY_BYTES` of UTF-8): found where the location is given, not as
    ``KeyTooLongError`` halfway through a save. ``what`` names the location's role."""
    size = len(location.key(longest).encode())
    if size <= MAX_KEY_BYTES:
        return
    prefix = len(location.prefix.encode())
    room = max(MAX_KEY_BYTES - (size - prefix), 0)
    shown = location.prefix if prefix <= 80 else location.prefix[:60] + "..."
    raise InvalidURIError(
        f"{what} s3://{location.bucket}/{shown} is too long: its prefix is {prefix:,} bytes "
        f"of UTF-8, and the longest key saved under it (the prefix and {longest!r}) would be "
        f"{size:,} bytes, over S3's limit of {MAX_KEY_BYTES:,} bytes; a prefix of at most "
        f"{room:,} bytes fits"
    )


def _valid_bucket(name: str) -> bool:
    if not 3 <= len(name) <= 63:
        return False
    allowed = set("abcdefghijklmnopqrstuvwxyz0123456789.-_")
    return set(name) <= allowed and name[0].isalnum() and name[-1].isalnum()
