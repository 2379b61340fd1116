"""Shared fixtures: one private S3 server per test session, and a unique prefix per test."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator

import pytest

from s3ckpt.testing.local_s3 import LocalS3Server


@pytest.fixture(scope="session")
def local_s3() -> Iterator[LocalS3Server]:
    """A started SeaweedFS server (bucket ``s3ckpt``), stopped at the end of the session.

    Session-scoped because starting one costs about a second; tests keep out of each
    other's way through :func:`s3_prefix`, not through separate servers.
    """
    with LocalS3Server() as server:
        yield server


@pytest.fixture
def s3_prefix(local_s3: LocalS3Server, request: pytest.FixtureRequest) -> str:
    """``s3://<bucket>/<test-name>-<random>``: a location no other test (or rerun) uses."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name).strip("-")[:80]
    return f"s3://{local_s3.bucket}/{name}-{secrets.token_hex(4)}"
