"""Which steps are committed, as :meth:`CheckpointManager.save` must know before it saves.

A resumed loop re-runs steps that an earlier run committed; those are kept (the save is
skipped), and finding out must cost the blocked training loop as little as possible:

* steps this manager saw committed (its own commits, a commit that lost to another
  writer) are known without a request;
* after :meth:`CheckpointManager.load` of step ``L``, the checkpoints above ``L`` belong
  to the run rolled back from: a step above ``L`` that this manager has not committed
  since is saved, over any such checkpoint (:meth:`CommittedSteps.replaces`), without a
  request;
* rank 0 lists the prefix once, at the first save (or when ``steps()`` lists it first):
  names and commit times only, no manifest read. A step missing from that listing costs
  no request later; a step in it is confirmed with one HEAD, since a rollback's
  retention may have deleted it since;
* when that listing fails, each save asks with one HEAD;
* a step another writer commits after the listing is caught by the commit itself
  (``CheckpointExistsError``: logged, not saved).

Every answer comes from rank 0 through the manager's ``on_rank0``, so all ranks agree.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from s3ckpt import catalog
from s3ckpt.config import S3URI, S3Config
from s3ckpt.errors import S3CkptError
from s3ckpt.manager.policy import checkpoint_name, parse_step

log = logging.getLogger("s3ckpt.manager")

OnRank0 = Callable[[Callable[[], Any]], Any]


class CommittedSteps:
    """The committed steps under one prefix, as far as a manager knows or asks."""

    def __init__(self, location: S3URI, config: S3Config, on_rank0: OnRank0) -> None:
        self._location = location
        self._config = config
        self._on_rank0 = on_rank0
        self._lock = threading.Lock()  # add() runs on the save's background thread
        self._seen: set[int] = set()  # committed, and not deleted since as far as known
        self._listed: frozenset[int] | None = None  # when listed: a HEAD confirms these
        self._list_tried = False
        self._loaded: int | None = None  # the step the run went on from, if it loaded one

    def add(self, steps: Iterable[int]) -> None:
        """Steps seen committed (a commit of this manager's, or one that lost to another)."""
        with self._lock:
            self._seen.update(steps)

    def loaded(self, step: int) -> None:
        """The run goes on from ``step``: what is saved above it from now on is this run's."""
        with self._lock:
            self._loaded = step
            self._seen = {s for s in self._seen if s <= step}

    def replaces(self, step: int) -> bool:
        """Whether ``step`` is to be saved over whatever is committed there: it is above
        the step the run loaded and this manager has not committed it since, so a
        checkpoint there is the rolled-back run's, which a restart must not resume from."""
        with self._lock:
            return self._loaded is not None and step > self._loaded and step not in self._seen

    def current(self) -> list[int]:
        """The committed steps not superseded by a rollback, ascending (one listing, on
        rank 0). The listing also serves :meth:`includes`."""
        every, current = self._on_rank0(self._listing)
        self._remember(every)
        return current

    def includes(self, step: int) -> bool:
        """Whether ``step`` is committed (see the module docstring for what that costs)."""
        with self._lock:
            if step in self._seen:
                return True
        if not self._list_tried:
            outcome = self._on_rank0(self._listing_or_none)
            self._list_tried = True
            if outcome is not None:
                self._remember(outcome[0])
        if self._listed is not None and step not in self._listed:
            return False
        uri = str(self._location.child(checkpoint_name(step)))
        return bool(self._on_rank0(lambda: catalog.is_committed(uri, config=self._config)))

    def _remember(self, every: frozenset[int]) -> None:
        self._listed, self._list_tried = every, True

    def _listing(self) -> tuple[frozenset[int], list[int]]:
        """Every committed step, and those not superseded by a rollback."""
        names = catalog.committed_names(str(self._location), config=self._config)
        steps = [(parse_step(name), later) for name, later in names.items()]
        every = frozenset(step for step, _ in steps if step is not None)
        return every, sorted(step for step, later in steps if step is not None and not later)

    def _listing_or_none(self) -> tuple[frozenset[int], list[int]] | None:
        try:
            return self._listing()
        except S3CkptError as exc:
            log.debug("could not list %s (%s); asking per step", self._location, exc)
            return None
