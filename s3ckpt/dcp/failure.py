"""A failed DCP call, raised as an s3ckpt error: what ``CheckpointManager`` and
``TierSave.result`` raise, so that their callers catch the documented hierarchy
(``s3ckpt.errors``) and nothing else."""

from __future__ import annotations

from typing import NoReturn

from s3ckpt.dcp.compat import CheckpointException, unwrap
from s3ckpt.errors import CheckpointError, S3CkptError


def reraise(exc: BaseException, doing: str = "") -> NoReturn:
    """Raise ``exc`` as an s3ckpt error, chained to it: the one a rank raised inside DCP's
    ``CheckpointException`` (a ``BaseException``, which ``except Exception`` misses), or
    ``exc`` itself if it is one, else a :class:`~s3ckpt.errors.CheckpointError` whose
    first line is ``doing`` and ``exc``'s own (a planner's ``RuntimeError``, an
    ``AssertionError`` of DCP's). ``KeyboardInterrupt`` and the like go on as they are."""
    error = unwrap(exc)
    if isinstance(error, S3CkptError) or not isinstance(error, (Exception, CheckpointException)):
        if error is exc:
            raise exc
        raise error from exc
    if isinstance(error, CheckpointException):  # one without failures: its first word only
        text = str(error.args[0]) if error.args else ""
    else:
        text = str(error)
    cause = f"{type(error).__name__}: {text}" if text else type(error).__name__
    raise CheckpointError(f"{doing} failed: {cause}" if doing else cause) from exc
