"""Shared fixtures: private S3 servers per test session, and a unique prefix per test.

Two real S3 implementations run: SeaweedFS (``seaweedfs_s3``, the default behind
``local_s3``) and moto's server (``moto_s3``). A module runs its tests against both with
``s3_servers.ON_BOTH``.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from s3_servers import MotoS3Server

from s3ckpt.testing.local_s3 import LocalS3Server


@pytest.fixture(scope="session")
def seaweedfs_s3() -> Iterator[LocalS3Server]:
    """A started SeaweedFS server (bucket ``s3ckpt``), stopped at the end of the session.

    Session-scoped because starting one costs about a second; tests keep out of each
    other's way through :func:`s3_prefix`, not through separate servers.
    """
    with LocalS3Server() as server:
        yield server


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3Server]:
    """moto's S3 server (bucket ``s3ckpt``), started on first use."""
    with MotoS3Server() as server:
        yield server


@pytest.fixture
def local_s3(request: pytest.FixtureRequest) -> Any:
    """The S3 server of this test: SeaweedFS unless parametrized (``s3_servers.ON_BOTH``)."""
    return request.getfixturevalue(getattr(request, "param", "seaweedfs_s3"))


@pytest.fixture
def s3_prefix(local_s3: Any, request: pytest.FixtureRequest) -> str:
    """``s3://<bucket>/<test-name>-<random>``: a location no other test (or rerun) uses."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name).strip("-")[:80]
    return f"s3://{local_s3.bucket}/{name}-{secrets.token_hex(4)}"
