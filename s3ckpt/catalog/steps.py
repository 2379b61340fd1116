"""How checkpoints are named by training step: one rule for every reader. No I/O.

:class:`~s3ckpt.CheckpointManager` writes step ``N`` as ``step-<N:010d>``
(:func:`step_name`): ten digits, so plain LIST order is step order. Other writers name
steps their own way (``step-300``: torchtitan, hand-written ``S3StorageWriter`` loops,
``TieredCheckpointProcess`` examples), so every reader of steps (the manager's
``steps()`` and ``load_latest``, retention, ``s3ckpt ls``/``prune``, the memory tier's
restore, the integrations) accepts any ``step-<digits>`` name as step ``int(digits)``
(:func:`step_of`).

Two committed names of one step (``step-300`` and ``step-0000000300``) resolve to one:
the padded name when it is among them, else the shortest (:func:`preferred`,
:func:`same_step`). A name that looks like a step but is not one (``step-12a``,
``step-300.hf-source``, ``step--1``) is never taken for one: :func:`not_a_step` says
why, for the log. :mod:`s3ckpt.catalog.run_listing` applies these to a run's listing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from s3ckpt.errors import ConfigError

PREFIX = "step-"
_STEP = re.compile(r"step-([0-9]+)")
_LOOKS_LIKE = re.compile(r"step(?:[-_]|[0-9]|$)", re.IGNORECASE)


def step_name(step: int) -> str:
    """``step-0000000300``: the name :class:`~s3ckpt.CheckpointManager` saves step 300
    under (ten digits or more, so that LIST order is step order)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step must be a non-negative int, got {step!r}")
    return f"{PREFIX}{step:010d}"


def step_of(name: str) -> int | None:
    """The step a checkpoint name stands for: ``step-300`` and ``step-0000000300`` are
    both 300; None for any name that is not ``step-`` followed by ASCII digits only."""
    match = _STEP.fullmatch(name)
    return int(match.group(1)) if match else None


def not_a_step(name: str) -> str | None:
    """Why ``name`` looks like a step but is not one (for the log), or None when it is a
    step or does not look like one (``latest``, ``best-model``, ``steps``)."""
    if step_of(name) is not None or not _LOOKS_LIKE.match(name):
        return None
    rest = name[len(PREFIX) :] if name.startswith(PREFIX) else None
    if rest is None:
        return f"{name!r} is not a step name: steps are named 'step-<digits>'"
    if not rest:
        return f"{name!r} has no step number after 'step-'"
    digits = re.match(r"[0-9]*", rest).group(0)  # type: ignore[union-attr]
    if not digits:
        return f"{name!r} is not a step name: 'step-' is followed by {rest!r}, not a number"
    return (
        f"{name!r} is not a step name: step {int(digits)} is followed by "
        f"{rest[len(digits) :]!r} (steps are named 'step-<digits>')"
    )


def preferred(names: Iterable[str]) -> str:
    """The one name a step is known by among several names of it: the padded
    :func:`step_name` when present, else the shortest (then the first in sort order)."""
    ordered = sorted(names, key=lambda n: (len(n), n))
    if not ordered:
        raise ValueError("no names")
    step = step_of(ordered[0])
    padded = step_name(step) if step is not None else None
    return padded if padded in ordered else ordered[0]


def misnamed(name: str) -> bool:
    """Whether ``name`` (its last part) starts as a step name and is not one: ``step-12a``,
    ``step-300.hf-source``, ``step--1``. Retention never counts or deletes such a name;
    names further from it (``step_300``, ``best``) are other tools' conventions."""
    last = leaf(name)
    return last.startswith(PREFIX) and step_of(last) is None


def leaf(name: str) -> str:
    """The last part of a checkpoint name relative to a listed prefix (``run2/step-3`` ->
    ``step-3``): the part that names the step."""
    return name.rsplit("/", 1)[-1]


def same_step(names: list[str]) -> dict[str, str]:
    """The names of a step named more than once in one folder, each mapped to the name
    the step is known by (:func:`preferred`, which maps to nobody):
    ``{"step-300": "step-0000000300"}``. Names may hold a folder (``run2/step-300``)."""
    folders: dict[tuple[str, int], list[str]] = {}
    for name in names:
        step = step_of(leaf(name))
        if step is not None:
            folders.setdefault((name[: len(name) - len(leaf(name))], step), []).append(name)
    shadows: dict[str, str] = {}
    for (folder, _), found in folders.items():
        if len(found) > 1:
            main = folder + preferred(leaf(n) for n in found)
            shadows.update((n, main) for n in found if n != main)
    return shadows
