"""DCP's ``Metadata`` to bytes and back, without letting a hostile bucket run code.

DCP's metadata is a pickled object graph. s3ckpt writes it with pickle (protocol 4) but
reads it with a restricted unpickler that resolves only the globals DCP's metadata and
s3ckpt's own records need (:func:`~s3ckpt.dcp.compat.metadata_global`: every dtype,
memory format and layout of the running torch and DCP's metadata classes;
:class:`~s3ckpt.format.rank_index.ItemOwners` in format 2,
:class:`~s3ckpt.format.layout.StoredItem` per item in format 1), so loading a checkpoint
can never import or call anything else.

A refused global is :class:`~s3ckpt.errors.UntrustedPickleError`, not corruption: the
bytes passed their checksum. The writer reads every metadata object back through the same
unpickler before it commits (:func:`check_loadable`), so a save never commits metadata
that a default load would refuse.

The pickle names ``StoredItem`` by the import path it had when the checkpoint was written.
Releases up to 0.1.0 kept it in ``s3ckpt.layout``; :data:`_STORED_ITEM_PATHS` resolves every
path it has had to today's class, so moving it never strands a checkpoint.
"""

from __future__ import annotations

import io
import pickle

from s3ckpt.dcp.compat import Metadata, metadata_global
from s3ckpt.errors import CorruptCheckpointError, UntrustedPickleError
from s3ckpt.format.layout import StoredItem
from s3ckpt.format.rank_index import ItemOwners
from s3ckpt.transfer.collector import collector_paused

_STORED_ITEM_PATHS = {
    (StoredItem.__module__, "StoredItem"),  # written by this release
    ("s3ckpt.layout", "StoredItem"),  # written by 0.1.0
}


_ITEM_OWNERS_PATH = (ItemOwners.__module__, "ItemOwners")


class _RefusedGlobal(pickle.UnpicklingError):
    def __init__(self, name: str) -> None:
        super().__init__(f"global {name} is not allowed in checkpoint metadata")
        self.name = name


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if (module, name) in _STORED_ITEM_PATHS:
            return StoredItem
        if (module, name) == _ITEM_OWNERS_PATH:
            return ItemOwners
        allowed = metadata_global(module, name)
        if allowed is None:
            raise _RefusedGlobal(f"{module}.{name}")
        return allowed


def dumps(metadata: Metadata) -> bytes:
    with collector_paused():  # every object's state is a transient dict
        return pickle.dumps(metadata, protocol=4)


def loads(data: bytes, where: str, *, trust_pickles: bool = False) -> Metadata:
    """Unpickle metadata read from ``where``.

    A global outside the allowlist is :class:`UntrustedPickleError` (unless
    ``trust_pickles``, which unpickles with plain :mod:`pickle`); anything else unexpected
    is :class:`CorruptCheckpointError`.
    """
    try:
        if trust_pickles:
            metadata = pickle.loads(data)
        else:
            metadata = _RestrictedUnpickler(io.BytesIO(data)).load()
    except _RefusedGlobal as exc:
        raise UntrustedPickleError(
            f"checkpoint metadata {where} names {exc.name}, which s3ckpt does not load by "
            "default: it could run code. If you trust the bucket, pass trust_pickles=True "
            "to S3StorageReader",
            refused=exc.name,
        ) from exc
    except Exception as exc:
        raise CorruptCheckpointError(f"unreadable checkpoint metadata {where}: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where} does not hold DCP metadata")
    return metadata


def check_loadable(data: bytes, where: str) -> None:
    """Before a commit: the metadata about to be written loads as a default load reads it,
    or the save fails, naming the global such a load would refuse."""
    try:
        with collector_paused():  # the whole metadata, built and dropped at once
            loads(data, where)
    except UntrustedPickleError as exc:
        raise UntrustedPickleError(
            f"the metadata of the save into {where} names {exc.refused}, which loads refuse "
            "without trust_pickles=True; nothing was committed (save that value as a tensor "
            "or as plain Python values instead)",
            refused=exc.refused,
        ) from exc
