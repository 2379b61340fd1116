"""Retention after each commit of a :class:`~s3ckpt.manager.CheckpointManager`: which
checkpoints the policy deletes (by the rules ``s3ckpt prune`` applies,
:mod:`s3ckpt.catalog.retention`), applied on one background thread, in commit order."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from s3ckpt import catalog
from s3ckpt.catalog.retention import Candidate, plan_retention
from s3ckpt.catalog.steps import step_of
from s3ckpt.config import S3URI, S3Config
from s3ckpt.manager.policy import checkpoint_name

log = logging.getLogger("s3ckpt.manager")


def retention_victims(
    infos: Iterable[catalog.CheckpointInfo],
    *,
    keep_last: int | None,
    keep_every: int | None,
    protect: str,
    now: float,
) -> list[str]:
    """Names retention deletes: committed steps (:func:`s3ckpt.step_of`: ``step-300`` as
    well as ``step-0000000300``) the policy expires, by the rules ``s3ckpt prune`` applies.

    Never ``protect`` (the checkpoint just written, which is not the highest step after a
    rollback) and never a name that is not a step (other runs, checkpoints kept by hand
    under the same prefix, ``step-300.hf-source``).
    """
    mine = [
        Candidate(i.name, i.time, i.in_flight)
        for i in infos
        if i.committed and step_of(i.name) is not None
    ]
    decisions = plan_retention(mine, keep_last=keep_last or 0, keep_every=keep_every, now=now)
    return [d.name for d in decisions if d.delete and d.name != protect]


class Retention:
    """Applies the policy after each commit on one background thread, in commit order.

    Deleting is a LIST and a few DELETEs: cheap, but never worth blocking training for,
    and never worth failing a run for, so errors are logged, not raised.

    ``keep_last`` counts committed checkpoints, and a save that died does not change the
    count: a checkpoint marked busy only by in-flight records written before this
    manager's first commit (a save of an earlier run of the job, killed while it
    overwrote the checkpoint, whose record stays fresh for minutes) is not a save in
    flight. A save still running from before would have rewritten its record since
    (every ``HEARTBEAT_S``); one that has not yet is no worse off for the deletion (its
    commit writes the checkpoint again).
    """

    def __init__(
        self, location: S3URI, config: S3Config, keep_last: int | None, keep_every: int | None
    ) -> None:
        self.location, self.config = location, config
        self.keep_last, self.keep_every = keep_last, keep_every
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="s3ckpt-retention")
        self._last: Future[None] | None = None
        self._since: float | None = None  # the store's time of this manager's first commit

    @property
    def enabled(self) -> bool:
        return self.keep_last is not None or self.keep_every is not None

    def after_commit(self, step: int) -> None:
        if self.enabled:
            self._last = self._executor.submit(self._apply, step)

    def wait(self) -> None:
        """Until the retention runs submitted so far are done (they run in order)."""
        last = self._last
        if last is not None:
            last.result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def _apply(self, step: int) -> None:
        try:
            infos = catalog.list_checkpoints(str(self.location), config=self.config)
            if self._since is None:
                mine = (i.time for i in infos if i.committed and i.name == checkpoint_name(step))
                self._since = next(mine, None)
            if self._since is not None and any(i.committed and i.in_flight for i in infos):
                infos = self._without_dead_saves(infos, self._since)
            victims = retention_victims(
                infos,
                keep_last=self.keep_last,
                keep_every=self.keep_every,
                protect=checkpoint_name(step),
                now=time.time(),
            )
        except Exception:
            log.warning(
                "retention after step %d: could not list %s", step, self.location, exc_info=True
            )
            return
        for name in victims:
            try:
                catalog.remove_checkpoint(str(self.location.child(name)), config=self.config)
                log.info("retention: removed %s", name)
            except Exception as exc:  # the next run retries; a missing one is already gone
                log.warning("retention: could not remove %s: %s", name, exc)

    def _without_dead_saves(
        self, infos: list[catalog.CheckpointInfo], since: float
    ) -> list[catalog.CheckpointInfo]:
        """``infos``, with checkpoints whose in-flight records all predate ``since`` no
        longer in flight (one more listing, for the records' times; see the class)."""
        listed = catalog.run_steps(str(self.location), config=self.config).committed
        dead = {
            name
            for name, found in listed.items()
            if found.writing and all(at < since for _, at in found.writing)
        }
        for name in sorted(dead):
            log.info("%s: the save that was overwriting it died; not a save in flight", name)
        return [dataclasses.replace(i, in_flight=False) if i.name in dead else i for i in infos]
