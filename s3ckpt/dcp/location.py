"""What the DCP writer and reader share: a connection config, an ``s3://`` location and
the store of its bucket, with one retry budget per save or load.

``S3Config.deadline_s`` bounds a whole save (from ``set_up_storage_writer``: the check,
the uploads, the index objects, the commit) or a whole load (from ``read_metadata``), not
each of its phases: every store handed out until the next save or load starts shares one
deadline, so a save that keeps failing ends within ``deadline_s`` plus one request.
"""

from __future__ import annotations

import os
import time
from typing import ClassVar

from s3ckpt.config import S3URI, S3Config
from s3ckpt.errors import ConfigError
from s3ckpt.s3.retry import Tally
from s3ckpt.s3.store import ObjectStore


class S3Location:
    """Mixin for :class:`~s3ckpt.S3StorageWriter` and :class:`~s3ckpt.S3StorageReader`.

    DCP passes ``checkpoint_id`` either to the constructor's caller or to ``reset``; both
    end up here, parsed and validated, so a bad URI fails before any I/O.
    """

    config: S3Config
    location: S3URI | None
    _deadline: float | None = None  # time.monotonic() at which retrying stops
    _tally: Tally | None = None  # the retries of the save or load under way; None: none started
    _dcp_call: ClassVar[str] = "dcp"  # named in the error when no location was given

    def _set_location(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        if checkpoint_id is not None:
            self.location = S3URI.parse(checkpoint_id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.checkpoint_id!r}, endpoint_url={self.config.endpoint_url!r})"

    @property
    def checkpoint_id(self) -> str | None:
        return str(self.location) if self.location else None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return str(checkpoint_id).startswith("s3://")

    def _require_location(self) -> S3URI:
        if self.location is None:
            raise ConfigError(
                f"no checkpoint location: pass s3://bucket/prefix to {type(self).__name__} or {self._dcp_call}"
            )
        return self.location

    def _start_budget(self) -> None:
        """Start the retry budget of a new save or load: ``S3Config.deadline_s`` from now,
        shared by every request of every phase until the next one starts."""
        seconds = self.config.deadline_s
        self._deadline = None if seconds is None else time.monotonic() + seconds
        self._tally = Tally()

    @property
    def retries(self) -> int:
        """Requests retried (transient failures) by this rank in the save or load under way
        or last finished."""
        return self._tally.retries if self._tally is not None else 0

    def _store(self) -> ObjectStore:
        """A store for the location's bucket, bounded by the deadline of the save or load
        under way (started now if none is: a caller outside DCP's lifecycle)."""
        if self._tally is None:
            self._start_budget()
        bucket = self._require_location().bucket
        return ObjectStore(self.config, bucket, deadline=self._deadline, tally=self._tally)
