"""Which committed checkpoints a retention policy deletes: a pure function, no I/O.

Deleting checkpoints is the one irreversible thing s3ckpt does, so the decision is kept
apart from the deleting and tested exhaustively. Every checkpoint gets a
:class:`Decision` with the reason it is kept, which ``prune --dry-run`` prints.

Order ("oldest first"): checkpoints are ordered by name with numbers compared as numbers
(``step-9`` < ``step-10`` < ``step-100``), then by commit time. Names carry the training
step, and the step is what "newest" means to someone resuming training. Names without
numbers sort alphabetically.

Step names (:mod:`s3ckpt.catalog.steps`, the rule ``CheckpointManager`` reads by): a name
that starts as a step name but is not one (``step-12a``, ``step-300.hf-source``,
``step--1``) is never counted nor deleted (``not a step``). A step named twice in one folder
(``step-300`` and ``step-0000000300``) counts once, by the name it is known by (the
padded one); the other name goes with it: kept while it is kept (``same step as NAME``),
deleted when it expires.

Superseded checkpoints: a run that rolls back (resumes from ``step-300`` while a run that
died left ``step-400``) and then commits ``step-310`` has abandoned ``step-400``: training
goes on from 310, and a restart must resume from there. So a checkpoint is *superseded*
when a lower step of the same series (the same name but for its last number, such as
``run/step-N``) was committed after it (commit times from the server's clock). Superseded
checkpoints are not "newest" and do not count towards ``keep_last``: after the rollback's
first commit they are deleted, unless ``keep_every`` or ``older_than`` keeps them.
``s3ckpt ls`` marks them, and ``CheckpointManager`` never resumes from one.

A checkpoint is deleted only if every rule allows it:

* a save is not writing into it right now (``busy``: a live in-flight record);
* it is not one of the last ``keep_last`` in that order, superseded ones left out;
* with ``keep_every=K``, its step (the last number in its name) is not a multiple of ``K``
  (names without a number are not protected by this rule);
* with ``older_than=T``, it was committed more than ``T`` seconds before ``now``;
* it is not the newest checkpoint, unless ``force``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from s3ckpt.catalog.steps import misnamed, same_step
from s3ckpt.errors import ConfigError

_NUMBER = re.compile(r"(\d+)")


@dataclass(frozen=True)
class Candidate:
    """A committed checkpoint: its name and commit time (seconds since the epoch)."""

    name: str
    time: float
    busy: bool = False  # a save is writing into it (a live in-flight record)


@dataclass(frozen=True)
class Decision:
    """A retention policy's verdict on one committed checkpoint: whether it is deleted,
    and the reason it is kept or deleted (what ``prune --dry-run`` prints)."""

    name: str
    time: float
    delete: bool
    reason: str  # why it is kept, or why deleted: "expired", "superseded by <name>"


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


def series_of(name: str) -> str | None:
    """The name with its last number blanked (``run/step-300`` -> ``run/step-#``), or None."""
    parts = _NUMBER.split(name)
    if len(parts) < 3:
        return None
    return "".join(parts[:-2]) + "#" + parts[-1]


def superseded(candidates: list[Candidate]) -> dict[str, str]:
    """Checkpoints superseded by a rollback (module docstring): name -> the lower step
    committed after it (the latest-committed one, when several were)."""
    series: dict[str, list[Candidate]] = {}
    for candidate in candidates:
        key = series_of(candidate.name)
        if key is not None:
            series.setdefault(key, []).append(candidate)
    found: dict[str, str] = {}
    for members in series.values():
        latest: Candidate | None = None  # committed last among the lower steps seen so far
        for candidate in sorted(members, key=lambda c: (step_of(c.name), c.time)):
            if latest is not None and latest.time > candidate.time:
                found[candidate.name] = latest.name
            if latest is None or candidate.time > latest.time:
                latest = candidate
    return found


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
    everything = order(candidates)
    not_steps = {c.name for c in everything if misnamed(c.name)}
    counted = [c for c in everything if c.name not in not_steps]
    replaced_by = superseded(counted)
    shadow_of = same_step([c.name for c in counted if c.name not in replaced_by])
    current = [c for c in counted if c.name not in replaced_by and c.name not in shadow_of]
    reasons: dict[str, tuple[str | None, str]] = {}
    for position, candidate in enumerate(current):
        from_newest = len(current) - 1 - position
        reason = _keep_reason(candidate, from_newest, keep_last, now, keep_every, older_than, force)
        reasons[candidate.name] = (reason, "expired")
    for name, by in replaced_by.items():
        candidate = next(c for c in everything if c.name == name)
        reason = _keep_reason(candidate, None, 0, now, keep_every, older_than, force=True)
        reasons[name] = (reason, f"superseded by {by}")
    for name, main in shadow_of.items():  # goes with the name its step is known by
        busy = next(c for c in everything if c.name == name).busy
        kept, why = reasons[main]
        reasons[name] = ("save in flight" if busy else kept and f"same step as {main}", why)
    for name in not_steps:
        reasons[name] = ("not a step", "")
    return [
        Decision(
            c.name, c.time, reasons[c.name][0] is None, reasons[c.name][0] or reasons[c.name][1]
        )
        for c in everything
    ]


def _keep_reason(
    candidate: Candidate,
    from_newest: int | None,  # None: superseded, outside the count
    keep_last: int,
    now: float,
    keep_every: int | None,
    older_than: float | None,
    force: bool,
) -> str | None:
    """Why ``candidate`` is kept, or None if it is to be deleted."""
    if candidate.busy:
        return "save in flight"
    if from_newest == 0 and not force:
        return "newest"
    if from_newest is not None and from_newest < keep_last:
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
