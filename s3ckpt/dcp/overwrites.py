"""What a load does when the checkpoint it reads is overwritten under it.

A load never returns a state that mixes two saves. The coordinator names, in every rank's
load plan, the save it planned from and how many ranks load (:class:`LoadAgreement`). A
rank that read another save (an overwrite committed between two ranks' reads of the
manifest) stops with :class:`~s3ckpt.errors.CheckpointReplacedError`; so does a rank of a
multi-rank load that meets a vanished data object (the checkpoint overwritten and the
replaced save collected meanwhile), since its ranks cannot all move to the newer save at
once without a collective. DCP hands a rank's error to every rank. Only a one-rank load
follows the overwrite, when the newer save still :func:`describes` what it reads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from s3ckpt.config import S3URI
from s3ckpt.dcp.compat import LoadPlan, Metadata
from s3ckpt.dcp.metadata_read import committed_manifest
from s3ckpt.dcp.owners import ChunkPositions
from s3ckpt.errors import (
    CheckpointReplacedError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    S3CkptError,
)
from s3ckpt.format.rank_index import ItemOwners
from s3ckpt.s3.store import ObjectStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadAgreement:
    """What the coordinator tells each rank in ``LoadPlan.storage_data``: the save it
    planned from and how many ranks load."""

    save_id: str
    ranks: int


def check_agreement(location: S3URI | None, mine: str, agreed: LoadAgreement | None) -> None:
    """This rank read the save the coordinator planned from."""
    if agreed is not None and agreed.save_id != mine:
        raise CheckpointReplacedError(
            f"{location} was overwritten while the ranks of this load read it "
            f"(this rank read save {mine}, the coordinator save {agreed.save_id}): "
            "nothing was loaded from a mix of the two; load again"
        )


async def latest_save_id(
    store: ObjectStore, location: S3URI, missing: ObjectNotFoundError
) -> str | None:
    """The save committed at ``location`` now; ``None`` if that cannot be read."""
    try:
        return (await committed_manifest(store, location)).save_id
    except S3CkptError as exc:
        log.warning("could not read %s again after %s: %s", location, missing.key, exc)
        return None


def replaced_error(
    location: S3URI, read: str, latest: str | None, missing: ObjectNotFoundError
) -> S3CkptError:
    """The error of a multi-rank load whose object ``missing`` vanished: a damaged
    checkpoint if the save read is still the committed one, else a replaced one."""
    if latest is None:
        return missing
    if latest == read:
        return CorruptCheckpointError(
            f"{location} is committed but its object {missing.key} is missing"
        )
    return CheckpointReplacedError(
        f"{location} was overwritten during the load (save {read} replaced by {latest}, "
        f"its object {missing.key} removed): every rank stops rather than return a state "
        "that mixes two saves; load again"
    )


def describes(metadata: Metadata, plan: LoadPlan) -> bool:
    """Whether ``metadata`` stores every item ``plan`` reads (after an overwrite)."""
    storage = metadata.storage_data
    if storage is None:
        return False
    if not isinstance(storage, ItemOwners):
        return all(r.storage_index in storage for r in plan.items)
    positions = ChunkPositions(metadata)
    try:
        for request in plan.items:
            index = request.storage_index
            storage.rank_of(index.fqn, positions.of(index))
    except KeyError:
        return False
    return True
