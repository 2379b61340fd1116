"""One writer process of the versioning race (``test_versioned_buckets.py``): it saves
once to its own checkpoint (its first commit probes conditional writes, on a bucket
without versioning), waits while versioning is switched on, then saves to the same
checkpoint id as its rivals every round, in step with them, and reports how it ended.

Lives in an importable module because the processes start with ``spawn``.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import torch.distributed.checkpoint as dcp
from _commit_race_worker import race, state_of

from s3ckpt import S3StorageWriter


def race_after_switch(
    writer: int,
    rounds: int,
    prefix: str,
    options: dict[str, Any],
    barrier: Any,
    results: multiprocessing.Queue,  # type: ignore[type-arg]
) -> None:
    own = S3StorageWriter(f"{prefix}/own-{writer}", **options)
    dcp.save(state_of(writer), storage_writer=own)  # the probe runs here, unversioned
    barrier.wait(timeout=300)  # every writer has probed
    barrier.wait(timeout=300)  # versioning is on
    race(writer, rounds, prefix, options, barrier, results)
