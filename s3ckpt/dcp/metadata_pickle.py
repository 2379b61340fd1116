"""DCP's ``Metadata`` to bytes and back, without letting a hostile bucket run code.

DCP's metadata is a pickled object graph. s3ckpt writes it with pickle (protocol 4) but
reads it with a restricted unpickler that resolves only the globals DCP's metadata and
s3ckpt's own records need (:class:`~s3ckpt.format.rank_index.ItemOwners` in format 2,
:class:`~s3ckpt.format.layout.StoredItem` per item in format 1), so loading a checkpoint
can never import or call anything else.

The pickle names ``StoredItem`` by the import path it had when the checkpoint was written.
Releases up to 0.1.0 kept it in ``s3ckpt.layout``; :data:`_STORED_ITEM_PATHS` resolves every
path it has had to today's class, so moving it never strands a checkpoint.
"""

from __future__ import annotations

import io
import pickle

from s3ckpt.dcp.compat import METADATA_PICKLE_GLOBALS, Metadata
from s3ckpt.errors import CorruptCheckpointError
from s3ckpt.format.layout import StoredItem
from s3ckpt.format.rank_index import ItemOwners

_STORED_ITEM_PATHS = {
    (StoredItem.__module__, "StoredItem"),  # written by this release
    ("s3ckpt.layout", "StoredItem"),  # written by 0.1.0
}


_ITEM_OWNERS_PATH = (ItemOwners.__module__, "ItemOwners")


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if (module, name) in _STORED_ITEM_PATHS:
            return StoredItem
        if (module, name) == _ITEM_OWNERS_PATH:
            return ItemOwners
        if (module, name) not in METADATA_PICKLE_GLOBALS:
            raise pickle.UnpicklingError(
                f"global {module}.{name} is not allowed in checkpoint metadata"
            )
        return super().find_class(module, name)


def dumps(metadata: Metadata) -> bytes:
    return pickle.dumps(metadata, protocol=4)


def loads(data: bytes, where: str) -> Metadata:
    """Unpickle metadata read from ``where``; anything unexpected is CorruptCheckpointError."""
    try:
        metadata = _RestrictedUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise CorruptCheckpointError(f"unreadable checkpoint metadata {where}: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where} does not hold DCP metadata")
    return metadata
