"""One writer process of the commit race (``test_commit_safety.py``): it saves to the same
checkpoint id as its rivals every round, in step with them, and reports how it ended.

Lives in an importable module because the processes start with ``spawn``.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import S3StorageWriter, unwrap

ELEMENTS = 64 * 1024  # 256 KiB of float32 per save


def state_of(writer: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((ELEMENTS,), float(writer))}


def race(
    writer: int,
    rounds: int,
    prefix: str,
    options: dict[str, Any],
    barrier: Any,
    results: multiprocessing.Queue,  # type: ignore[type-arg]
) -> None:
    for number in range(rounds):
        barrier.wait(timeout=300)
        uri = f"{prefix}/round-{number}"
        try:
            dcp.save(state_of(writer), storage_writer=S3StorageWriter(uri, **options))
            outcome = "committed"
        except BaseException as exc:
            error = unwrap(exc)
            outcome = f"{type(error).__name__}: {error}"
        results.put((number, writer, outcome))
