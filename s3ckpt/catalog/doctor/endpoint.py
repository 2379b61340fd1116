"""The doctor's first check: the endpoint exactly as requests will use it (the URL the S3
client resolved) and where it was configured, the transport (TLS and what verifies it,
or plain HTTP), the credentials and the bucket; an endpoint that answers but not as S3
does fails it with :class:`~s3ckpt.errors.NotS3EndpointError`'s message."""

from __future__ import annotations

from typing import TYPE_CHECKING

from s3ckpt.config import S3Config
from s3ckpt.errors import BucketNotFoundError, NotS3EndpointError, S3CkptError, StorageError
from s3ckpt.s3.client import client_handle, tls_verify
from s3ckpt.s3.compat_botocore import configured_endpoint, ignored_s3_endpoint
from s3ckpt.s3.error_mapping import translated

if TYPE_CHECKING:
    from s3ckpt.catalog.doctor.probe import Probe


async def reach(probe: Probe) -> bool:
    """Whether the endpoint answers as S3 and the bucket is accessible (the other checks
    run only then); records the endpoint, its source and the transport."""
    config = probe.store.config
    try:
        with translated("CreateClient", probe.store.bucket):
            client = await client_handle(config).get()
    except S3CkptError as exc:
        probe.add("endpoint, credentials, bucket", "failed", str(exc))
        return False
    endpoint = probe.diagnosis.endpoint = str(client.meta.endpoint_url)
    probe.diagnosis.endpoint_source = endpoint_source(config, endpoint)
    try:
        await probe.store.head_bucket()
    except BucketNotFoundError as exc:
        await _not_s3_or(probe, exc)
        return False
    except StorageError as exc:
        probe.add("endpoint, credentials, bucket", "failed", f"{exc}{_at(probe)}")
        return False
    detail = (
        f"{endpoint} ({probe.diagnosis.endpoint_source}) answers; {_transport(config, endpoint)}"
    )
    probe.add("endpoint and TLS", "ok", detail)
    probe.add("credentials and bucket", "ok", f"s3://{probe.store.bucket} is accessible")
    return True


async def _not_s3_or(probe: Probe, missing: StorageError) -> None:
    """A HEAD's bare 404 is S3's "no such bucket", and a web server's too: a listing,
    which S3 explains with an XML error, tells them apart."""
    try:
        async for _ in probe.store.list(probe.scratch + "/"):
            break
    except NotS3EndpointError as exc:
        probe.add("endpoint, credentials, bucket", "failed", f"{exc}{_at(probe)}")
        return
    except StorageError:
        pass
    probe.add("endpoint, credentials, bucket", "failed", f"{missing}{_at(probe)}")


def _at(probe: Probe) -> str:
    return f" (endpoint {probe.diagnosis.endpoint}, {probe.diagnosis.endpoint_source})"


def endpoint_source(config: S3Config, endpoint: str) -> str:
    """Where ``endpoint``, the URL the client for ``config`` sends requests to, came from:
    the configuration's ``endpoint_url`` (``--endpoint-url``), the environment, the AWS
    config file's profile or services section, or none (AWS's own endpoint)."""
    if config.endpoint_url is not None:
        return "from --endpoint-url / S3Config.endpoint_url"
    found = configured_endpoint(config.profile, endpoint)
    if found is None:
        ignored = ignored_s3_endpoint(config.profile)
        note = (
            f"; the endpoint_url {ignored} in the s3 section of profile "
            f"{config.profile or 'default'} is not read: AWS tools take it from a "
            "services section"
            if ignored
            else ""
        )
        return f"AWS's own endpoint: none configured{note}"
    where = f"profile {found.profile} in {found.config_file}"
    return {
        "environment_service": "from AWS_ENDPOINT_URL_S3",
        "environment_global": "from AWS_ENDPOINT_URL",
        "config_service": f"from s3's endpoint_url in [services {found.services}] of {where}",
        "config_global": f"from the endpoint_url of {where}",
    }.get(found.location, f"from {found.location} ({where})")


def _transport(config: S3Config, endpoint: str) -> str:
    """What protects the connection: TLS and how it is verified, or nothing."""
    if not endpoint.lower().startswith("https:"):
        return "plain HTTP: the connection is not encrypted (no TLS)"
    verify = tls_verify(config)
    if verify is False:
        return "TLS, certificate not verified (--no-verify-ssl / verify=False)"
    bundle = f"the CA bundle {verify}" if isinstance(verify, str) else "botocore's CA bundle"
    return f"TLS verified against {bundle}"
