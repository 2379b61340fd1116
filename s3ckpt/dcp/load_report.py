"""What a load did not restore as saved, said once: one warning, or with ``strict`` an error.

DCP loads what its target has room for and nothing else, casting to the target's dtype
without a word: a saved entry no rank's target has (a renamed module, an optimizer state
the target lacks) is skipped, and an fp16 target takes fp32 data. The readers
(:class:`~s3ckpt.dcp.reader.S3StorageReader`, :class:`~s3ckpt.dcp.state_reader.StateReader`)
keep a :class:`LoadReport` per load:

* **Entries no rank took**, found on the coordinator in ``prepare_global_plan``, which sees
  every rank's plan beside the metadata (no collective): each with its saved bytes.
* **Conversions**, found where the rank resolves its target tensors (``resolve_tensor``),
  before it issues a read: an entry whose target's dtype or shape is not the saved one.

After the reads, the report is logged once as one WARNING on ``s3ckpt.dcp.load_report``
(a long list named in part, with the count and bytes of the rest); the coordinator's names the
entries left out, each rank's the conversions of its own targets. With ``strict=True`` the
load raises :class:`~s3ckpt.errors.StateMismatchError` instead, before any byte is loaded:
the coordinator in planning (DCP hands the error to every rank), each rank for its
conversions before its first read.

Loads that read part of a checkpoint on purpose (an export's windows) run under
:func:`reading_part`: what they leave out is not reported. Loads under :func:`strict_loads`
are strict whatever their reader was given (the manager's restores from the memory tier).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from s3ckpt.dcp.compat import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    Metadata,
    ReadItem,
    TensorStorageMetadata,
)
from s3ckpt.errors import StateMismatchError

log = logging.getLogger(__name__)

SHOWN = 8
"""Entries named in a report; the rest are counted."""

_PART: ContextVar[bool] = ContextVar("s3ckpt_reading_part", default=False)
_STRICT: ContextVar[bool] = ContextVar("s3ckpt_strict_loads", default=False)


@contextlib.contextmanager
def reading_part() -> Iterator[None]:
    """The loads of this block read part of a checkpoint on purpose: the saved entries
    their targets leave out are not reported (conversions still are)."""
    token = _PART.set(True)
    try:
        yield
    finally:
        _PART.reset(token)


@contextlib.contextmanager
def strict_loads(strict: bool = True) -> Iterator[None]:
    """The loads of this block are strict if ``strict``, whatever their readers were given."""
    token = _STRICT.set(strict)
    try:
        yield
    finally:
        _STRICT.reset(token)


def report_for(where: str, strict: bool) -> LoadReport:
    """A fresh report for a load of ``where`` (strict if asked, or under :func:`strict_loads`)."""
    return LoadReport(where, strict or _STRICT.get())


@dataclass
class LoadReport:
    """What one load (on one rank) left out or converted."""

    where: str  # the checkpoint, for the message
    strict: bool = False
    dropped: dict[str, int | None] = field(default_factory=dict)  # entry -> saved bytes
    converted: dict[str, tuple[str, int]] = field(default_factory=dict)  # entry -> (what, bytes)
    said: bool = False

    def find_dropped(
        self,
        metadata: Metadata,
        plans: list[LoadPlan],
        stored_size: Callable[[str], int | None] = lambda fqn: None,
    ) -> None:
        """On the coordinator: the saved entries no rank's plan reads (``stored_size``
        gives a non-tensor entry's bytes, if known). Raises if ``strict``."""
        if _PART.get():
            return
        read = {item.storage_index.fqn for plan in plans for item in plan.items}
        self.dropped = {
            fqn: _saved_bytes(md) if isinstance(md, TensorStorageMetadata) else stored_size(fqn)
            for fqn, md in metadata.state_dict_metadata.items()
            if fqn not in read
        }
        if self.strict and self.dropped:
            raise StateMismatchError(f"{self._message()}; nothing was loaded", self.dropped, {})

    def add_left_out(self, fqns: list[str], metadata: Metadata | None) -> None:
        """Entries this rank planned to read but could not place (and did not load)."""
        entries = metadata.state_dict_metadata if metadata is not None else {}
        for fqn in fqns:
            md = entries.get(fqn)
            self.dropped[fqn] = _saved_bytes(md) if isinstance(md, TensorStorageMetadata) else None

    def watching(self, planner: LoadPlanner, metadata: Metadata) -> Any:
        """``planner`` with each target it resolves compared with the saved entry."""
        return _WatchingPlanner(planner, metadata, self)

    def check_targets(self, plan: LoadPlan, planner: LoadPlanner, metadata: Metadata) -> None:
        """With ``strict``: resolve every target of ``plan`` now and raise if any needs a
        conversion, before a read is issued."""
        if not self.strict:
            return
        watching = _WatchingPlanner(planner, metadata, self)
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                watching.resolve_tensor(item)
        if self.converted:
            raise StateMismatchError(
                f"{self._message()}; nothing was loaded on this rank", {}, dict(self.converted)
            )

    def finish(self) -> None:
        """Log the report once (nothing when the load restored everything as saved)."""
        if self.said or not (self.dropped or self.converted):
            return
        self.said = True
        log.warning("%s (strict=True raises instead)", self._message())

    def _message(self) -> str:
        parts = []
        if self.dropped:
            dropped = {f"{fqn!r}": n for fqn, n in self.dropped.items()}
            parts.append(f"{_count(len(dropped))} saved, no target took: {_listed(dropped)}")
        if self.converted:
            converted = {f"{fqn!r} {what}": n for fqn, (what, n) in self.converted.items()}
            parts.append(f"{_count(len(converted))} loaded with a conversion: {_listed(converted)}")
        return f"load of {self.where} did not restore the state as saved: " + "; ".join(parts)

    def _saw(self, item: ReadItem, destination: torch.Tensor, md: Any) -> None:
        if not isinstance(md, TensorStorageMetadata):
            return
        stored = md.properties.dtype
        what = []
        if destination.dtype != stored:
            what.append(f"{_dtype(stored)} -> {_dtype(destination.dtype)}")
        if tuple(destination.shape) != tuple(item.lengths):
            what.append(f"{list(item.lengths)} -> {list(destination.shape)}")
        if not what:
            return
        fqn = item.storage_index.fqn
        nbytes = math.prod(item.lengths) * stored.itemsize
        before = self.converted.get(fqn)
        self.converted[fqn] = (", ".join(what), nbytes + (before[1] if before else 0))


class _WatchingPlanner:
    """A planner whose resolved targets are compared with the saved entries."""

    def __init__(self, planner: LoadPlanner, metadata: Metadata, report: LoadReport) -> None:
        self._planner = planner
        self._entries = metadata.state_dict_metadata
        self._report = report
        self._seen: set[Any] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        destination = self._planner.resolve_tensor(item)
        key = (item.dest_index, tuple(item.dest_offsets), item.storage_index)
        if key not in self._seen:  # a retried item is resolved again
            self._seen.add(key)
            self._report._saw(item, destination, self._entries.get(item.storage_index.fqn))
        return destination


def _saved_bytes(md: TensorStorageMetadata) -> int:
    return sum(math.prod(chunk.sizes) for chunk in md.chunks) * md.properties.dtype.itemsize


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _count(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def _listed(entries: dict[str, int | None]) -> str:
    """The :data:`SHOWN` largest entries with their bytes, then how many more and theirs."""
    names = sorted(entries, key=lambda name: (-(entries[name] or 0), name))
    shown = [name + _size(entries[name]) for name in names[:SHOWN]]
    rest = names[SHOWN:]
    if rest:
        shown.append(f"and {len(rest)} more" + _size(sum(entries[name] or 0 for name in rest)))
    total = sum(n or 0 for n in entries.values())
    return ", ".join(shown) + f" [{_bytes(total)} in all]"


def _size(n: int | None) -> str:
    return f" ({_bytes(n)})" if n else ""


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


__all__ = ["SHOWN", "LoadReport", "reading_part", "report_for", "strict_loads"]
