"""The steps under a run's prefix, read by the one rule of :mod:`s3ckpt.catalog.steps`.

What ``CheckpointManager`` (``steps()``, ``load_latest``), the integrations and scripts
that name their own checkpoints (``TieredCheckpointProcess``'s ``s3_latest``) ask of a
run: which steps are committed, under which name, and which of them a rollback
superseded. It costs the listing ``ls`` makes (one request up to 1000 objects under the
prefix, then one per directory) and no manifest read but where the listing cannot tell
a checkpoint from another tool's ``manifest.json``: a directory with a manifest and no
metadata object (every s3ckpt commit writes one just before its manifest) has its
manifest read, and one that is not s3ckpt's is no step (as the catalog reads them,
:func:`~s3ckpt.catalog.api.alist_checkpoints`); ``folders=True`` adds one
delimiter listing of the run's top level (one request per 1000 names) to find folders
named like steps that hold no s3ckpt checkpoint at all (a safetensors export, another
tool's format), and one request for each such folder (at most 16) to see that it holds
anything.

What the rule leaves out is never left out silently: every name that looks like a step
but is not one, every step named twice and every step folder without a committed
checkpoint (or whose ``manifest.json`` is another tool's) comes back as a :class:`Note` for the caller to log (``CheckpointManager``
logs each once).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from s3ckpt.catalog.clock import store_time
from s3ckpt.catalog.retention import Candidate, superseded
from s3ckpt.catalog.scan import (
    Group,
    Scan,
    child,
    open_store,
    relative,
    scan_checkpoints,
    timestamp,
)
from s3ckpt.catalog.steps import leaf, not_a_step, preferred, step_of
from s3ckpt.config import S3URI, S3Config
from s3ckpt.errors import ForeignObjectError
from s3ckpt.s3.loop import bounded, io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.commit import manifest_exists

_FOLDERS_CHECKED = 16  # folders named like steps, outside any checkpoint, looked into at most
_DIED = "a save in flight, or one that died: s3ckpt gc removes its objects"


@dataclass(frozen=True)
class Note:
    """A name under the run that is not used as a step, and why; ``warn``: worth a
    WARNING (a name that looks wrong, a step named twice), else INFO (an uncommitted or
    foreign step folder: a save that died, an export, another tool's manifest.json)."""

    name: str
    why: str
    warn: bool


Record = tuple[str, float]  # an in-flight record: its key and LastModified (store clock)


@dataclass(frozen=True)
class Committed:
    """A committed step name: its commit time and the in-flight records that mark a save
    writing into it (an overwrite), as :meth:`~s3ckpt.catalog.scan.Group.in_flight`
    judges them."""

    time: float
    writing: frozenset[Record] = frozenset()


@dataclass(frozen=True)
class RunSteps:
    """The committed steps directly under a run's prefix."""

    names: dict[int, str]  # step -> the name it is known by (the padded one if named twice)
    superseded: dict[int, str] = field(default_factory=dict)  # step -> the name superseding it
    notes: list[Note] = field(default_factory=list)
    committed: dict[str, Committed] = field(default_factory=dict)  # every committed step name

    def current(self) -> list[int]:
        """The committed steps a rollback has not superseded, ascending: the ones training
        goes on from."""
        return sorted(step for step in self.names if step not in self.superseded)

    def latest(self) -> int | None:
        """The highest current step, or None."""
        current = self.current()
        return current[-1] if current else None


def steps_named(committed: dict[str, str | None]) -> RunSteps:
    """The steps among committed names, each mapped to the name superseding it after a
    rollback (None: current), as :func:`s3ckpt.catalog.committed_names` gives them (pure)."""
    found: dict[int, list[str]] = {}
    notes: list[Note] = []
    for name in sorted(committed):
        step = step_of(name)
        if step is not None:
            found.setdefault(step, []).append(name)
        elif "/" in name and (step_of(leaf(name)) is not None or not_a_step(leaf(name))):
            notes.append(Note(name, f"{name} is below the run, not one of its steps", False))
        elif why := not_a_step(name):
            notes.append(Note(name, why, warn=True))
    names = {step: preferred(found_as) for step, found_as in found.items()}
    for step, found_as in sorted(found.items()):
        if len(found_as) > 1:
            used = names[step]
            others = ", ".join(n for n in found_as if n != used)
            why = f"step {step} is committed as {used} and as {others}: {used} is used"
            notes.append(Note(others, why, warn=True))
    by = {step: later for step, name in names.items() if (later := committed[name]) is not None}
    return RunSteps(names, by, notes)


def read_steps(
    scanned: Scan,
    folders: list[str] | None = None,
    now: float = 0.0,
    foreign: dict[str, str] | None = None,
) -> RunSteps:
    """The steps of a scan of the run's prefix (pure); ``folders``: the names at the
    run's top level, when they were listed; ``now``: the store's time, for the in-flight
    records' lease; ``foreign``: the directories whose ``manifest.json`` is not s3ckpt's,
    each with why (no checkpoint, so no step)."""
    foreign = foreign or {}
    groups = [g for g in scanned.groups.values() if g.committed and g.name not in foreign]
    replaced = superseded([Candidate(g.name, g.newest) for g in groups])
    found = steps_named({g.name: replaced.get(g.name) for g in groups})
    found.committed.update(
        (g.name, Committed(g.newest, _writing(g, now)))
        for g in groups
        if step_of(g.name) is not None
    )
    for group in sorted(scanned.groups.values(), key=lambda g: g.name):
        if group.name in foreign and step_of(group.name) is not None:
            found.notes.append(Note(group.name, foreign[group.name], False))
        elif group.name in foreign and (why := not_a_step(group.name)):
            found.notes.append(Note(group.name, why, warn=True))
        elif not group.committed and step_of(group.name) is not None:
            why = f"{group.name} holds no committed checkpoint ({_DIED})"
            found.notes.append(Note(group.name, why, False))
        elif not group.committed and (why := not_a_step(group.name)):
            found.notes.append(Note(group.name, why, warn=True))
    for name in sorted(set(folders or ()) - set(scanned.groups)):
        if step_of(name) is not None:
            why = f"{name} holds no s3ckpt checkpoint (no manifest.json)"
            found.notes.append(Note(name, why, False))
        elif why := not_a_step(name):
            found.notes.append(Note(name, why, warn=True))
    return found


def _writing(group: Group, now: float) -> frozenset[Record]:
    """The records that make ``group`` in flight, each judged alone."""
    alone = (m for m in group.saving if dataclasses.replace(group, saving=[m]).in_flight(now))
    return frozenset((m.key, timestamp(m)) for m in alone)


async def arun_steps(store: ObjectStore, location: S3URI, *, folders: bool = False) -> RunSteps:
    """The run's steps (module docstring); ``folders``: also list the run's top level."""
    root = f"{location.prefix}/" if location.prefix else ""

    async def top_level() -> list[str]:
        if not folders:
            return []
        entries = [e async for e in store.list_level(root)]
        return [relative(location.prefix, e.rstrip("/")) for e in entries if isinstance(e, str)]

    async def holds_objects(name: str) -> bool:
        """Some stores (SeaweedFS) list a folder whose objects are all deleted."""
        listing = store.list(child(location, name).key(""))
        try:
            async for _ in listing:
                return True
            return False
        finally:
            await listing.aclose()  # type: ignore[attr-defined]

    async def not_ours(name: str) -> str | None:
        """Why the manifest of ``name`` is not s3ckpt's; None when it is (or is gone)."""
        try:
            await manifest_exists(store, child(location, name))
        except ForeignObjectError as exc:
            return str(exc)
        return None

    scanned, names = await asyncio.gather(scan_checkpoints(store, location), top_level())
    candidates = [
        n for n in names if n not in scanned.groups and (step_of(n) is not None or not_a_step(n))
    ][:_FOLDERS_CHECKED]
    # Only a manifest whose directory shows no metadata object may be another tool's.
    suspects = [g.name for g in scanned.groups.values() if g.suspect]
    held, why = await asyncio.gather(
        bounded([lambda n=n: holds_objects(n) for n in candidates]),
        bounded([lambda n=n: not_ours(n) for n in suspects]),
    )
    foreign = {n: w for n, w in zip(suspects, why, strict=True) if w is not None}
    # in-flight records are judged by the store's clock; asked only when there are some
    writing = any(g.saving for g in scanned.groups.values() if g.committed)
    now = await store_time(store) if writing else time.time()
    folders_held = [n for n, h in zip(candidates, held, strict=True) if h]
    return read_steps(scanned, folders_held, now, foreign)


def run_steps(
    uri: str | S3URI, *, folders: bool = False, config: S3Config | None = None, **options: Any
) -> RunSteps:
    """The committed steps under ``uri`` (``s3://bucket/run``), by the rule every reader
    of steps shares: any ``step-<digits>`` name is step ``int(digits)``.

    Args:
        uri: the run, ``s3://bucket`` or ``s3://bucket/run``.
        folders: also list the run's top level, to note folders named like steps that
            hold no s3ckpt checkpoint (an export, another tool's format).
        config: connection and tuning (:class:`~s3ckpt.S3Config`; the defaults when None).
        **options: :class:`~s3ckpt.S3Config`'s fields by name, over ``config``.

    Returns:
        Each step with the name it is known by, the steps a rollback superseded, and a
        note for every name the rule leaves out, for the caller to log.

    Raises:
        ~s3ckpt.errors.InvalidURIError: ``uri`` is not an ``s3://`` URI.
        ~s3ckpt.errors.ConfigError: an unknown or invalid option.
        ~s3ckpt.errors.StorageError: a listing failed (a missing bucket:
            :class:`~s3ckpt.errors.BucketNotFoundError`).
    """
    store, location = open_store(uri, config, options, require_prefix=False)
    return io_loop().run(arun_steps(store, location, folders=folders))
