"""DCP's metadata for a checkpoint whose items are whole files.

A checkpoint written file by file (torch-checkpointing's, through
:mod:`s3ckpt.integrations.torch_checkpointing`) still carries DCP's metadata, so that
``dcp.load`` with an :class:`~s3ckpt.dcp.reader.S3StorageReader` can read it: one bytes
item per file, named by the file's path inside the checkpoint, and
:class:`~s3ckpt.format.rank_index.ItemOwners` saying which rank's index lists it.
"""

from __future__ import annotations

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from s3ckpt.format.rank_index import ItemOwners


def files_metadata(owners: dict[str, int]) -> Metadata:
    """The metadata of files ``owners`` maps to the rank that wrote each."""
    table = ItemOwners.build(dict.fromkeys(owners, 1), [(n, 0, r) for n, r in owners.items()])
    return Metadata(
        state_dict_metadata={name: BytesStorageMetadata() for name in owners},
        storage_data=table,
    )


def file_owners(metadata: Metadata) -> ItemOwners | None:
    """Which rank wrote each file, if ``metadata`` describes files only (else None: a
    checkpoint of tensors saved through DCP)."""
    owners = metadata.storage_data
    entries = metadata.state_dict_metadata.values()
    if isinstance(owners, ItemOwners) and all(isinstance(e, BytesStorageMetadata) for e in entries):
        return owners
    return None
