"""fsspec's ``s3://`` filesystem (s3fs) pointed at the endpoint s3ckpt uses.

Trainers check directories through fsspec before and after saving: Lightning's
``ModelCheckpoint`` asks whether its ``dirpath`` exists and is empty and whether a
checkpoint name is taken; torchtitan asks whether its folder and a ``step-N`` exist. For
an ``s3://`` path fsspec hands these to s3fs, which knows nothing of s3ckpt's
:class:`~s3ckpt.config.S3Config`: left alone it would ask AWS, not FlashBlade. fsspec
takes per-protocol defaults from ``fsspec.config.conf``; :func:`configure_fsspec` puts
the endpoint, credentials, TLS and addressing of an ``S3Config`` there, so every s3fs
filesystem created afterwards (by any library) talks to the same store.

Only settings that were given are written: anything left to the standard AWS chain
(``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, the shared files) is found by s3fs's botocore the
same way. Listing caches are turned off: a trainer asks whether a name exists right after
a save, and a cached listing would answer from before it.
"""

from __future__ import annotations

from typing import Any

import fsspec.config

from s3ckpt.config import S3Config

_PROTOCOL = "s3"


def s3fs_options(config: S3Config) -> dict[str, Any]:
    """The ``s3fs.S3FileSystem`` keyword arguments that reach the store ``config`` names."""
    options: dict[str, Any] = {"use_listings_cache": False}
    if config.endpoint_url is not None:
        options["endpoint_url"] = config.endpoint_url
    if config.access_key_id is not None:
        options["key"] = config.access_key_id
        options["secret"] = config.secret_access_key
    if config.session_token is not None:
        options["token"] = config.session_token
    if config.profile is not None:
        options["profile"] = config.profile
    client: dict[str, Any] = {}
    if config.region is not None:
        client["region_name"] = config.region
    if config.verify is not None:
        client["verify"] = config.verify
    if client:
        options["client_kwargs"] = client
    botocore: dict[str, Any] = {
        "s3": {"addressing_style": config.addressing_style},
        "connect_timeout": config.connect_timeout,
        "read_timeout": config.read_timeout,
    }
    if config.proxies is not None:
        botocore["proxies"] = dict(config.proxies)
    options["config_kwargs"] = botocore
    return options


def configure_fsspec(config: S3Config) -> None:
    """Make ``config``'s store the default of every s3fs filesystem created from now on.

    Process-wide (fsspec's configuration is): with several endpoints in one process, the
    last call wins. Explicit keyword arguments to ``fsspec.filesystem("s3", ...)`` still
    take precedence.
    """
    fsspec.config.conf[_PROTOCOL] = {
        **fsspec.config.conf.get(_PROTOCOL, {}),
        **s3fs_options(config),
    }
