"""Retention after each commit to a run: which checkpoints the policy deletes (by the rules
``s3ckpt prune`` applies, :mod:`s3ckpt.catalog.retention`), applied by the engine that
committed, after its commit is reported (the checkpoint process in process mode, the save
thread in thread mode, the manager after a synchronous save)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

from s3ckpt.catalog.listing import CheckpointInfo, list_checkpoints
from s3ckpt.catalog.removal import remove_checkpoint
from s3ckpt.catalog.retention import Candidate, plan_retention
from s3ckpt.catalog.run_listing import run_steps
from s3ckpt.catalog.steps import step_of
from s3ckpt.config import S3URI, S3Config

log = logging.getLogger("s3ckpt.manager")


def retention_victims(
    infos: Iterable[CheckpointInfo],
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


@dataclasses.dataclass
class RunRetention:
    """The retention policy of the run at ``location``, applied after each commit to it.

    Deleting is a LIST and a few DELETEs: never worth failing a run for, so errors are
    logged, not raised. It is pickled to the checkpoint process that applies it, and
    keeps what it learns across commits there.

    ``keep_last`` counts committed checkpoints, and a save that died does not change the
    count: a checkpoint marked busy only by in-flight records written before this run's
    first commit seen here (a save of an earlier run of the job, killed while it
    overwrote the checkpoint, whose record stays fresh for minutes) is not a save in
    flight. A save still running from before would have rewritten its record since
    (every ``HEARTBEAT_S``); one that has not yet is no worse off for the deletion (its
    commit writes the checkpoint again).
    """

    location: S3URI
    config: S3Config
    keep_last: int | None
    keep_every: int | None
    since: float | None = None  # the store's time of the first commit seen here

    @property
    def enabled(self) -> bool:
        return self.keep_last is not None or self.keep_every is not None

    def after_commit(self, checkpoint: S3URI) -> None:
        """Apply the policy after ``checkpoint`` was committed (never deleting it); a
        checkpoint that is not directly under this run changes nothing."""
        name = checkpoint.prefix.rpartition("/")[2]
        if not self.enabled or self.location.child(name) != checkpoint:
            return
        try:
            infos = list_checkpoints(str(self.location), config=self.config)
            if self.since is None:
                self.since = next((i.time for i in infos if i.committed and i.name == name), None)
            if self.since is not None and any(i.committed and i.in_flight for i in infos):
                infos = self._without_dead_saves(infos, self.since)
            victims = retention_victims(
                infos,
                keep_last=self.keep_last,
                keep_every=self.keep_every,
                protect=name,
                now=time.time(),
            )
        except Exception:
            log.warning("retention after %s: could not list %s", name, self.location, exc_info=True)
            return
        for victim in victims:
            try:
                remove_checkpoint(str(self.location.child(victim)), config=self.config)
                log.info("retention: removed %s", victim)
            except Exception as exc:  # the next run retries; a missing one is already gone
                log.warning("retention: could not remove %s: %s", victim, exc)

    def _without_dead_saves(
        self, infos: list[CheckpointInfo], since: float
    ) -> list[CheckpointInfo]:
        """``infos``, with checkpoints whose in-flight records all predate ``since`` no
        longer in flight (one more listing, for the records' times; see the class)."""
        listed = run_steps(str(self.location), config=self.config).committed
        dead = {
            name
            for name, found in listed.items()
            if found.writing and all(at < since for _, at in found.writing)
        }
        for name in sorted(dead):
            log.info("%s: the save that was overwriting it died; not a save in flight", name)
        return [dataclasses.replace(i, in_flight=False) if i.name in dead else i for i in infos]
