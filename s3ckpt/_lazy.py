"""Package attributes imported on first use (PEP 562).

The DCP adapters import torch and the catalog the S3 stack, each taking a while; a package
that re-exports them resolves each name on first access, so ``import s3ckpt`` and the
CLI's argument parsing stay instant.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_attributes(
    package: str, table: dict[str, str], namespace: dict[str, Any]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` resolving ``name`` from module ``table[name]``, once."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name]), name)
        namespace[name] = value
        return value

    return __getattr__
