"""The ``STATUS`` of a row of ``s3ckpt ls``: what a directory holds, in plain words.

The states (``docs/cli.md``): ``committed`` (with ``, superseded by NAME`` after a
rollback), ``saving``, ``uncommitted``, ``damaged`` and ``foreign``; a committed checkpoint
adds ``, overwrite in flight`` while a save writes into it. Where a save stopped (killed,
crashed), the status says so, what it left and when ``gc`` (default grace) removes it:
``committed, a stopped save left 3 objects, 1 open upload; gc removes them in 58m``.
A save whose in-flight record has missed its refreshes, but whose lease has not run out,
is ``silent``: most likely stopped, and ``gc`` still leaves it alone until the lease ends.
Catalog types are imported for type checking only, so importing this module stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from s3ckpt.cli.humanize import human_duration

if TYPE_CHECKING:
    from s3ckpt.catalog import CheckpointInfo


def status(info: CheckpointInfo, now: float) -> str:
    """The row's status; ``now`` in seconds since the epoch, for when ``gc`` acts."""
    if info.foreign:
        return "foreign"
    if info.damaged:
        return "damaged"
    if info.committed:
        head = "committed" + (f", superseded by {info.superseded_by}" if info.superseded_by else "")
        if info.running:
            return f"{head}, overwrite in flight"
        if info.gc_after is None:
            return head
        if info.silent is not None:
            return f"{head}, overwrite {_silent(info)}: {_left(info)} left; {_when(info, now)}"
        return f"{head}, a stopped save left {_left(info)}; {_when(info, now)}"
    if info.running:
        return "saving"
    if info.gc_after is None:
        return "uncommitted"
    how = _silent(info) if info.silent is not None else "stopped"
    return f"uncommitted, save {how}: {_left(info)} left; {_when(info, now)}"


def _silent(info: CheckpointInfo) -> str:
    return f"silent {human_duration(info.silent or 0)} (stopped?)"


def _left(info: CheckpointInfo) -> str:
    """``3 objects, 1 open upload``."""
    parts = [_count(info.left, "object")] if info.left else []
    return ", ".join(parts + ([_count(info.uploads, "open upload")] if info.uploads else []))


def _when(info: CheckpointInfo, now: float) -> str:
    """``gc removes them in 58m``: with its default grace, counted from the newest of them."""
    them = "it" if info.left + info.uploads == 1 else "them"
    wait = (info.gc_after or now) - now
    return f"gc removes {them} {f'in {human_duration(wait)}' if wait >= 1 else 'now'}"


def _count(number: int, what: str) -> str:
    return f"{number} {what}{'s' if number != 1 else ''}"
