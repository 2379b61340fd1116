"""Which committed checkpoints a retention policy deletes: a pure function, no I/O.

Deleting checkpoints is the one irreversible thing s3ckpt does, so the decision is kept
apart from the deleting and tested exhaustively. Every checkpoint gets a
:class:`Decision` with the reason it is kept, which ``prune --dry-run`` prints.

Order ("oldest first"): checkpoints are ordered by name with numbers compared as numbers
(``step-9`` < ``step-10`` < ``step-100``), then by commit time. Names carry the training
step, and the step is what "newest" means to someone resuming training: after rolling back
to ``step-500`` and re-saving ``step-600``, ``step-900`` of the abandoned run is still the
highest step. Names without numbers sort alphabetically.

A checkpoint is deleted only if every rule allows it:

* it is not one of the last ``keep_last`` in that order;
* with ``keep_every=K``, its step (the last number in its name) is not a multiple of ``K``
  (names without a number are not protected by this rule);
* with ``older_than=T``, it was committed more than ``T`` seconds before ``now``;
* it is not the newest checkpoint, unless ``force``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from s3ckpt.errors import ConfigError

_NUMBER = re.compile(r"(\d+)")


@dataclass(frozen=True)
class Candidate:
    """A committed checkpoint: its name and commit time (seconds since the epoch)."""

    name: str
    time: float


@dataclass(frozen=True)
class Decision:
    name: str
    time: float
    delete: bool
    reason: str  # why it is kept, or "expired"


def natural_key(name: str) -> tuple[object, ...]:
    """Sort key comparing digit runs as numbers: ``step-9`` before ``step-10``."""
    parts = _NUMBER.split(name)
    # split() alternates text and digits starting with text, so types match position-wise.
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts))


def order(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Oldest first: natural name order, then commit time, then the raw name."""
    return sorted(candidates, key=lambda c: (natural_key(c.name), c.time, c.name))


def step_of(name: str) -> int | None:
    """The last number in ``name`` (``run2/step-300`` -> 300), or None."""
    numbers = _NUMBER.findall(name)
    return int(numbers[-1]) if numbers else None


def plan_retention(
    candidates: Iterable[Candidate],
    *,
    keep_last: int,
    now: float,
    keep_every: int | None = None,
    older_than: float | None = None,
    force: bool = False,
) -> list[Decision]:
    """A decision for every candidate, oldest first (see the module docstring for the rules)."""
    validate_rules(keep_last, keep_every, older_than)
    ordered = order(candidates)
    decisions = []
    for position, candidate in enumerate(ordered):
        from_newest = len(ordered) - 1 - position
        reason = _keep_reason(candidate, from_newest, keep_last, now, keep_every, older_than, force)
        decisions.append(
            Decision(candidate.name, candidate.time, reason is None, reason or "expired")
        )
    return decisions


def _keep_reason(
    candidate: Candidate,
    from_newest: int,
    keep_last: int,
    now: float,
    keep_every: int | None,
    older_than: float | None,
    force: bool,
) -> str | None:
    """Why ``candidate`` is kept, or None if it is to be deleted."""
    if from_newest == 0 and not force:
        return "newest"
    if from_newest < keep_last:
        return f"last {keep_last}"
    step = step_of(candidate.name)
    if keep_every is not None and step is not None and step % keep_every == 0:
        return f"every {keep_every}"
    if older_than is not None and now - candidate.time <= older_than:
        return "too recent"
    return None


def validate_rules(keep_last: int, keep_every: int | None, older_than: float | None) -> None:
    """The one check of a retention policy, for ``prune`` and ``CheckpointManager`` alike.

    ``keep_last=0`` is valid: no checkpoint is kept for its rank alone, and the newest is
    still kept unless ``force``.
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int):
        raise ConfigError(f"keep_last must be an integer, got {keep_last!r}")
    if keep_last < 0:
        raise ConfigError(f"keep_last must be 0 or more, got {keep_last}")
    if keep_every is not None and keep_every < 1:
        raise ConfigError(f"keep_every must be 1 or more, got {keep_every}")
    if older_than is not None and older_than < 0:
        raise ConfigError(f"older_than must not be negative, got {older_than}")
