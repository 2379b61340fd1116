"""``Loading``: the load path of a :class:`~s3ckpt.CheckpointManager`, from ``load`` or
``load_latest`` to the state loaded in place.

It owns what a load decides and leaves behind: which step ``load_latest`` restores (from
the memory tier when every rank holds one at least as new as S3's newest, else from S3),
the reader's options (``strict``, ``reader_options``), ``last_restore``, and the rollback a
load of an older step starts (the committed steps, the memory tier's copies above it).
The committed steps and the memory tier are the manager's, handed in at construction.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch.distributed.checkpoint as dcp

from s3ckpt.background.ranks import Ranks
from s3ckpt.config import S3URI, S3Config
from s3ckpt.dcp.failure import reraise as _reraise
from s3ckpt.dcp.reader import S3StorageReader
from s3ckpt.manager import memory_tier as tiering
from s3ckpt.manager.committed import CommittedSteps
from s3ckpt.manager.policy import checkpoint_name
from s3ckpt.tier.rank import RankTier
from s3ckpt.tier.restore import Restored

log = logging.getLogger("s3ckpt.manager")


class Loading:
    """One manager's loads, and what the last one restored.

    Args:
        location, config: the run's ``s3://bucket/run`` and its connection.
        ranks: the ranks that load together.
        committed: the steps known committed (shared with the save path).
        tier: this rank's memory tier, or None.
        strict, reader_options: the manager's options of the same names.
    """

    def __init__(
        self,
        location: S3URI,
        config: S3Config,
        ranks: Ranks,
        committed: CommittedSteps,
        tier: RankTier | None,
        *,
        strict: bool,
        reader_options: dict[str, Any],
    ) -> None:
        self._location, self._config, self._ranks = location, config, ranks
        self._committed, self._tier = committed, tier
        self.strict, self.reader_options = strict, reader_options
        self.last_restore: Restored | None = None

    def uri_of(self, step: int) -> str:
        """Where step ``step`` is committed, or would be saved (``CheckpointManager.uri_of``)."""
        return str(self._location.child(self._committed.name(step)))

    def load_latest(self, state_dict: dict[str, Any]) -> int | None:
        """``CheckpointManager.load_latest`` once no save is in flight."""
        started = time.perf_counter()
        current = self._committed.current()
        step = current[-1] if current else None
        restored = tiering.restore_from_memory(self._tier, state_dict, step, self.strict)
        if restored is not None:
            self._went_on_from(restored.step)
            self.last_restore = restored
            log.info(
                "loaded %s from memory in %.2f s (%.3f s to choose it)",
                checkpoint_name(restored.step), restored.load_s, restored.select_s,
            )  # fmt: skip
            return restored.step
        if step is not None:
            selected = time.perf_counter()
            self.load(step, state_dict)
            done = time.perf_counter()
            self.last_restore = Restored(step, "s3", selected - started, done - selected)
        return step

    def load(self, step: int, state_dict: dict[str, Any]) -> None:
        """``CheckpointManager.load`` once no save is in flight."""
        started = time.perf_counter()
        reader = S3StorageReader(
            str(self._location.child(self._committed.resolve(step))),
            config=self._config,
            process_group=self._ranks.shared(),
            **{"strict": self.strict, **self.reader_options},
        )
        try:
            dcp.load(
                state_dict,
                storage_reader=reader,
                process_group=self._ranks.group,
                no_dist=not self._ranks.distributed,
            )
        except BaseException as exc:
            _reraise(exc, f"loading {self.uri_of(step)}")
        self._went_on_from(step)
        log.info("loaded %s in %.2f s", checkpoint_name(step), time.perf_counter() - started)

    def _went_on_from(self, step: int) -> None:
        """The run goes on from ``step``: what was saved above it is a rolled-back run's."""
        self._committed.loaded(step)
        if self._tier is not None:
            self._tier.discard_above(step)
