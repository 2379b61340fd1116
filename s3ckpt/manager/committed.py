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
* steps are read by the rule of :mod:`s3ckpt.catalog.steps`: any ``step-<digits>`` name
  (``step-300``, written by another tool, is step 300) and, of two names of one step, the
  padded one. Each listing says under which name a step is committed (what ``load``
  reads), and the first also lists the run's top level: every name there that is not
  used as a step (``step-12a``, a step folder without a manifest, a step named twice) is
  logged once, on rank 0, with the reason;
* when that listing fails, each save asks with one HEAD;
* a step another writer commits after the listing is caught by the commit itself
  (``CheckpointExistsError``: logged, not saved).

Every answer is found on rank 0 and shared through the manager's
:meth:`~s3ckpt.background.ranks.Ranks.from_rank0`, so all ranks agree.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

from s3ckpt import catalog
from s3ckpt.background.ranks import Ranks
from s3ckpt.catalog.run_listing import RunSteps
from s3ckpt.config import S3URI, S3Config
from s3ckpt.errors import S3CkptError
from s3ckpt.manager.policy import checkpoint_name

log = logging.getLogger("s3ckpt.manager")

T = TypeVar("T")
Listing = tuple[frozenset[int], list[int], dict[int, str]]  # every step, current ones, names


class CommittedSteps:
    """The committed steps under one prefix, as far as a manager knows or asks."""

    def __init__(self, location: S3URI, config: S3Config, ranks: Ranks) -> None:
        self._location = location
        self._config = config
        self._ranks = ranks
        self._lock = threading.Lock()  # add() runs on the save's background thread
        self._seen: set[int] = set()  # committed, and not deleted since as far as known
        self._listed: frozenset[int] | None = None  # when listed: a HEAD confirms these
        self._list_tried = False
        self._loaded: int | None = None  # the step the run went on from, if it loaded one
        self._names: dict[int, str] = {}  # steps listed under another name than checkpoint_name
        self._noted: set[str] = set()  # the notes logged already (rank 0)
        self._noted_once = False  # whether the run's top level was listed for notes

    def add(self, steps: Iterable[int]) -> None:
        """Steps seen committed (a commit of this manager's, or one that lost to another)."""
        with self._lock:
            for step in steps:
                self._seen.add(step)
                self._names.pop(step, None)  # committed under this manager's own name

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
        rank 0). The listing also serves :meth:`includes` and :meth:`name`."""
        every, current, names = self._on_rank0(self._listing)
        self._remember(every, names)
        return current

    def name(self, step: int) -> str:
        """The name ``step`` is committed under, as last listed: :func:`checkpoint_name`
        unless the listing found it only under another (``step-300``). No request."""
        with self._lock:
            return self._names.get(step) or checkpoint_name(step)

    def resolve(self, step: int) -> str:
        """:meth:`name`, listing first (on rank 0, every rank calls it) when the prefix was
        never listed; a listing that fails leaves :func:`checkpoint_name`."""
        if not self._list_tried:
            outcome = self._on_rank0(self._listing_or_none)
            self._list_tried = True
            if outcome is not None:
                self._remember(outcome[0], outcome[2])
        return self.name(step)

    def includes(self, step: int) -> bool:
        """Whether ``step`` is committed (see the module docstring for what that costs)."""
        with self._lock:
            if step in self._seen:
                return True
        self.resolve(step)
        if self._listed is not None and step not in self._listed:
            return False
        uri = str(self._location.child(self.name(step)))
        return bool(self._on_rank0(lambda: catalog.is_committed(uri, config=self._config)))

    def _on_rank0(self, ask: Callable[[], T]) -> T:
        """``ask()`` on rank 0 alone, its answer (or its error) on every rank."""
        outcome: T | Exception | None = None
        if self._ranks.rank == 0:
            try:
                outcome = ask()
            except Exception as exc:  # every rank raises it, rather than the others hanging
                outcome = exc
        return self._ranks.from_rank0(outcome)

    def _remember(self, every: frozenset[int], names: dict[int, str]) -> None:
        with self._lock:
            self._listed, self._list_tried = every, True
            self._names = names

    def _listing(self) -> Listing:
        """Every committed step, those not superseded by a rollback, and the steps
        committed under another name than :func:`checkpoint_name` (rank 0; the first
        listing also lists the run's top level for :meth:`_note`)."""
        found = catalog.run_steps(
            str(self._location), folders=not self._noted_once, config=self._config
        )
        self._note(found)
        names = {s: n for s, n in found.names.items() if n != checkpoint_name(s)}
        return frozenset(found.names), found.current(), names

    def _note(self, found: RunSteps) -> None:
        """Log, once per manager, each name under the run that is not used as a step."""
        self._noted_once = True
        for note in found.notes:
            if note.name not in self._noted:
                self._noted.add(note.name)
                level = logging.WARNING if note.warn else logging.INFO
                log.log(level, "%s: %s; not used as a step", self._location, note.why)

    def _listing_or_none(self) -> Listing | None:
        try:
            return self._listing()
        except S3CkptError as exc:
            log.debug("could not list %s (%s); asking per step", self._location, exc)
            return None
