"""The exception hierarchy: every error s3ckpt raises on purpose derives from S3CkptError.

::

    S3CkptError
    ├── ConfigError (ValueError)               bad options or arguments
    │   ├── InvalidURIError                    not an s3://bucket/key URI, or a key too long
    │   ├── UnpicklableStateError              a state value the checkpoint process cannot rebuild
    │   └── OutputExistsError (FileExistsError)  an export's output holds files, no overwrite
    ├── StorageError                           the object store said no
    │   ├── EndpointError (ConnectionError)    unreachable endpoint, TLS failure, timeout
    │   │   └── NotS3EndpointError             the endpoint answers, but not as S3 does
    │   ├── AccessDeniedError (PermissionError) wrong or missing credentials, no permission
    │   ├── BucketNotFoundError
    │   ├── ObjectNotFoundError (FileNotFoundError)
    │   ├── PreconditionFailedError            a conditional write lost its race
    │   ├── StoreFullError                     the store is full, over quota, or the object too large
    │   └── TransientStorageError              throttling or 5xx that outlived the retries
    │       ├── DeadlineExceededError          the save's (or load's) retry budget ran out
    │       └── StoreStalledError              the store stopped taking (or sending) bytes
    ├── CheckpointError                        checkpoint-level problems
    │   ├── CheckpointNotFoundError (FileNotFoundError)  no committed manifest
    │   ├── CheckpointExistsError (FileExistsError)      saving over a commit without overwrite
    │   ├── CommitConflictError                another writer committed the same id first
    │   ├── IncompleteSaveError                an object of the save vanished before its commit
    │   ├── CheckpointReplacedError            overwritten while a multi-rank load read it
    │   ├── CorruptCheckpointError             checksum or size mismatch, unreadable manifest
    │   ├── StateMismatchError                 a strict load's state does not take the save as saved
    │   ├── ForeignObjectError                 a manifest.json that is not s3ckpt's
    │   ├── UntrustedPickleError               a pickle names a Python global loads refuse
    │   ├── CheckpointProcessError             the checkpoint process died or could not start
    │   ├── MemoryTierError                    the memory tier's root lacks the room or access
    │   └── NotACheckpointError                an import source in no format s3ckpt reads
    └── LocalServerError                       the embedded S3 server could not start

Messages name the bucket, key and operation involved and never contain credentials, nor
terminal escape sequences (torch colours some of the text an error carries: removed here).
The standard-library bases let callers who do not know s3ckpt still catch the
natural category (``except FileNotFoundError``).
"""

from __future__ import annotations

import re

_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # ANSI colours and styles (CSI sequences)


class S3CkptError(Exception):
    """Base class of every error raised by s3ckpt."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(plain_text(arg) if isinstance(arg, str) else arg for arg in args))


def plain_text(text: str) -> str:
    """``text`` without terminal escape sequences (torch's bold and colours)."""
    return _ESCAPES.sub("", text) if "\x1b" in text else text


class ConfigError(S3CkptError, ValueError):
    """An option or argument is invalid."""


class InvalidURIError(ConfigError):
    """A checkpoint location is not a valid ``s3://bucket/prefix`` URI, or its prefix is
    too long for the keys a save writes under it (S3 keys are at most 1,024 bytes)."""


class UnpicklableStateError(ConfigError):
    """A value of the state (``key``: its path, ``extra.obj``) cannot be rebuilt by the
    checkpoint process, which unpickles the state in a fresh interpreter: a class or
    function of ``__main__`` or defined inside a function, a lambda, a module that
    process cannot import, or anything pickle refuses. Found by ``save()`` before
    anything is copied or uploaded."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class OutputExistsError(ConfigError, FileExistsError):
    """The folder or prefix an export writes to already holds files, and overwrite was
    not requested."""


class StorageError(S3CkptError):
    """The object store failed a request.

    ``operation`` is the S3 operation (``PutObject``...), ``code`` the S3 error code when
    the server sent one, ``bucket``/``key`` the target.
    """

    def __init__(
        self,
        message: str,
        *,
        operation: str | None = None,
        code: str | None = None,
        bucket: str | None = None,
        key: str | None = None,
    ) -> None:
        super().__init__(message)
        self.operation = operation
        self.code = code
        self.bucket = bucket
        self.key = key


class EndpointError(StorageError, ConnectionError):
    """The endpoint could not be reached, the TLS handshake failed, or a request timed out."""


class NotS3EndpointError(EndpointError):
    """The endpoint answered, but not as an S3 server does: an error with no S3 error in
    its body (an HTML page, an empty body), or an HTML page where S3 sends its XML. The
    endpoint is most likely not the S3 service (a web server, a console's port, a path
    missing from the URL); ``code`` is the HTTP status it answered with."""


class AccessDeniedError(StorageError, PermissionError):
    """The credentials are wrong, missing, or lack permission."""


class BucketNotFoundError(StorageError):
    """The bucket does not exist."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The object does not exist."""


class PreconditionFailedError(StorageError):
    """A conditional request (``If-None-Match: *``) found the object already there."""


class StoreFullError(StorageError):
    """The store refused the bytes for lack of room: it is full (HTTP 507,
    ``InsufficientStorage``, MinIO's ``XMinioStorageFull``), the bucket or its owner is
    over quota (``QuotaExceeded``, as Ceph RGW answers), or the object is larger than the
    store takes (``EntityTooLarge``; ``code`` tells which). Not retried: room does not
    come back by asking again. Nothing of the save is committed; the previous checkpoint
    stays the loadable one."""


class TransientStorageError(StorageError):
    """Throttling or a server error that persisted through every retry."""


class DeadlineExceededError(TransientStorageError):
    """A request failed after the time budget of its save or load (``S3Config.deadline_s``)
    was spent, so it was not retried; the cause is the last failure."""


class StoreStalledError(TransientStorageError):
    """A request made no progress for ``S3Config.stall_timeout_s``: its tries, each on a
    fresh connection, moved no byte and got no answer (a store that filled up and hangs
    instead of answering, a gateway that stopped forwarding). The save fails then rather
    than at its deadline, and is not retried further; the message names the operation,
    the key and the store's last answer to this process. The store may recover: the
    next save tries again."""


class CheckpointError(S3CkptError):
    """A checkpoint-level problem."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint (no manifest) exists at the location."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint already exists and overwrite was not requested."""


class CommitConflictError(CheckpointError):
    """Another writer committed the same checkpoint id first."""


class IncompleteSaveError(CheckpointError):
    """An object of the save was gone when the commit checked (deleted by ``gc`` with too
    short a grace, a lifecycle rule or a person); nothing was committed."""


class CheckpointReplacedError(CheckpointError):
    """The checkpoint was overwritten (and the replaced save's objects removed) while a load
    read it, and the load could not move to the newer save on every rank at once: no rank
    returns a state mixing two saves. Loading again reads the newer one."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes do not match their recorded size or checksum, or a manifest is unreadable."""


class ForeignObjectError(CheckpointError):
    """An object under a name s3ckpt writes is not s3ckpt's (another tool's
    ``manifest.json``): no checkpoint is there, and s3ckpt leaves the object alone."""


class StateMismatchError(CheckpointError):
    """A strict load (``strict=True``) found saved entries that no rank's target takes, or
    targets that would take an entry with a dtype or shape conversion; nothing was
    loaded. ``dropped``: entry -> saved bytes (None if unknown); ``converted``: entry ->
    (the conversion, bytes)."""

    def __init__(
        self,
        message: str,
        dropped: dict[str, int | None] | None = None,
        converted: dict[str, tuple[str, int]] | None = None,
    ) -> None:
        super().__init__(message)
        self.dropped = dict(dropped or {})
        self.converted = dict(converted or {})


class UntrustedPickleError(CheckpointError):
    """Checkpoint metadata or a non-tensor item names a Python global (a class, a function)
    outside what s3ckpt loads by default. The bytes are sound; loading them would run
    code the bucket chose. ``trust_pickles=True`` loads them, for buckets you trust."""

    def __init__(self, message: str, refused: str | None = None) -> None:
        super().__init__(message)
        self.refused = refused


class CheckpointProcessError(CheckpointError):
    """The checkpoint process died (killed, out of memory) or could not start; the save it
    was running is not committed, and the next save starts a fresh process."""


class MemoryTierError(CheckpointError):
    """The memory tier cannot hold its copies: its shared-memory root is missing, not
    writable, or too small for the copies kept (found at construction where the size is
    stated, else when a copy's memory is reserved, never as a crash later)."""


class NotACheckpointError(CheckpointError):
    """An import source is none of what s3ckpt imports: a DCP checkpoint folder, safetensors
    files (or their index) or a ``torch.save`` file of tensors."""


class LocalServerError(S3CkptError):
    """The embedded local S3 server could not be started or stopped."""
