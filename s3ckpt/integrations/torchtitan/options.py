"""The checks of ``S3CheckpointManager.Config``'s own fields: no credentials in the
configuration (torchtitan logs it), and the ``MemoryTier`` its ``memory_tier`` keywords
describe."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from s3ckpt.errors import ConfigError
from s3ckpt.tier.options import MemoryTier

SECRETS = frozenset({"access_key_id", "secret_access_key", "session_token"})


def memory_tier_of(options: Mapping[str, Any]) -> MemoryTier:
    """The ``MemoryTier`` a configuration's ``memory_tier`` keywords describe."""
    try:
        return MemoryTier(**options)
    except TypeError as exc:
        raise ConfigError(f"memory_tier: {exc}") from None
