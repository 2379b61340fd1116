"""The torch-free half of :class:`~s3ckpt.manager.CheckpointManager`: names, options and
metrics (retention is :mod:`s3ckpt.catalog.run_retention`'s). How steps are named is
:mod:`s3ckpt.catalog.steps`'s, shared with every other reader of steps.

Kept apart so that the rules a training run depends on (how steps are named and sorted,
what a save's metrics mean) are pure functions tested without torch, S3 or threads, and
so that the manager module stays about the one thing that needs torch: driving DCP's
saves and loads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from s3ckpt.catalog.retention import validate_rules
from s3ckpt.catalog.steps import step_name, step_of
from s3ckpt.errors import ConfigError
from s3ckpt.units import human_bytes, human_rate

IfBusy = Literal["wait", "skip"]
"""What ``save`` does while the previous upload runs: wait for it, or skip this save."""
AsyncMode = Literal["thread", "process", "sync"]
"""Where the upload runs: the rank's checkpoint process, a thread of the training process,
or the caller (``dcp.save``)."""


def checkpoint_name(step: int) -> str:
    """``step-0000000100``: the name the manager saves a step under (:func:`s3ckpt.step_name`)."""
    return step_name(step)


def parse_step(name: str) -> int | None:
    """The step of a checkpoint name (:func:`s3ckpt.step_of`): ``step-100`` and
    ``step-0000000100`` are both 100."""
    return step_of(name)


def validate_options(
    keep_last: int | None, keep_every: int | None, if_busy: str, async_mode: str
) -> None:
    """Fail at construction, not at the first save hours into a run."""
    if if_busy not in ("wait", "skip"):
        raise ConfigError(f"if_busy must be 'wait' or 'skip', got {if_busy!r}")
    if async_mode not in ("thread", "process", "sync"):
        raise ConfigError(f"async_mode must be 'thread', 'process' or 'sync', got {async_mode!r}")
    validate_rules(0 if keep_last is None else keep_last, keep_every, None)


@dataclass(frozen=True)
class SaveMetrics:
    """One committed save.

    ``blocked_s``: seconds ``save()`` held the training loop (``waited_s`` of them waiting
    for the previous upload, the rest staging); ``upload_s``: from ``save()`` returning to
    the commit; ``bytes``: the tensor bytes of the state saved, all ranks (before any
    compression);
    ``throughput_mb_s``: bytes / upload_s in MB/s (10**6 bytes).
    With a memory tier, ``held_s``: from ``save()`` returning until this rank's copy was
    held in memory; ``replicated_s``: until every rank's copy had reached its peers on
    other nodes (None with one node); ``to_s3``: False for a save held only in memory
    (then ``bytes`` is this rank's, and nothing was uploaded or committed).
    """

    step: int
    blocked_s: float
    upload_s: float
    bytes: int
    throughput_mb_s: float
    waited_s: float = 0.0
    held_s: float | None = None
    to_s3: bool = True
    replicated_s: float | None = None

    @classmethod
    def of(
        cls,
        step: int,
        blocked: float,
        upload: float,
        nbytes: int,
        waited: float,
        *,
        held_s: float | None = None,
        to_s3: bool = True,
        replicated_s: float | None = None,
    ) -> SaveMetrics:
        throughput = nbytes / 1e6 / max(upload, 1e-9) if to_s3 else 0.0
        return cls(step, blocked, upload, nbytes, throughput, waited, held_s, to_s3, replicated_s)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        held = "" if self.held_s is None else f", held in memory after {self.held_s:.3f} s"
        if self.replicated_s is not None:
            held += f", replicated after {self.replicated_s:.3f} s"
        if not self.to_s3:
            return (
                f"{checkpoint_name(self.step)} held in memory: {human_bytes(self.bytes)} "
                f"on this rank, blocked {self.blocked_s:.3f} s{held}"
            )
        return (
            f"{checkpoint_name(self.step)} committed: {human_bytes(self.bytes)}, "
            f"blocked {self.blocked_s:.3f} s, upload {self.upload_s:.2f} s "
            f"({human_rate(self.throughput_mb_s * 1e6)}){held}"
        )
