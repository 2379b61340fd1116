"""Fixtures of the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from scripted_servers import ScriptedServers


@pytest.fixture
def serve() -> Iterator[ScriptedServers]:
    """Scripted servers on loopback for the data plane's requests (:class:`ScriptedServers`)."""
    servers = ScriptedServers()
    yield servers
    servers.close()
