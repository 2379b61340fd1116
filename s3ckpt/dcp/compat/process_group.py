"""What a process group says beyond torch.distributed's public API: where its ranks met
(the default ``TCPStore``'s host) and how long its collectives wait."""

from __future__ import annotations

from typing import Any

import torch


def default_store_host() -> str | None:
    """The host the default process group met at, when it met through a ``TCPStore``
    (DCP's private ``_get_default_store``): where ranks on other nodes reach rank 0."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    while not isinstance(store, dist.TCPStore) and hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store.host if isinstance(store, dist.TCPStore) else None


def group_timeout(group: Any = None) -> float | None:
    """Seconds a collective of ``group`` (default: the default group) waits for its peers,
    as the job set it at ``init_process_group`` (its CPU backend's options); None where
    torch does not say."""
    import torch.distributed as dist

    try:
        backend = (group or dist.group.WORLD)._get_backend(torch.device("cpu"))
        return float(backend.options._timeout.total_seconds())
    except Exception:
        return None
