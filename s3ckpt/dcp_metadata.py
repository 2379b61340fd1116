"""DCP's ``Metadata`` to bytes and back, without letting a hostile bucket run code.

DCP's metadata is a pickled object graph. s3ckpt writes it with pickle (protocol 4) but
reads it with a restricted unpickler that resolves only the globals DCP's metadata and
s3ckpt's :class:`~s3ckpt.layout.StoredItem` need, so loading a checkpoint can never
import or call anything else.
"""

from __future__ import annotations

import io
import pickle

from s3ckpt.compat import METADATA_PICKLE_GLOBALS, Metadata
from s3ckpt.errors import CorruptCheckpointError

_ALLOWED = METADATA_PICKLE_GLOBALS | {("s3ckpt.layout", "StoredItem")}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in _ALLOWED:
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
