"""What ``s3ckpt doctor`` found: one :class:`Check` per probe, and the :class:`Diagnosis`
that gathers them with what s3ckpt will do on the store."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Status = Literal["ok", "degraded", "failed"]


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str


@dataclass
class Diagnosis:
    """``endpoint``: the URL requests go to, as the client resolved it; ``endpoint_source``:
    where it was configured (:func:`endpoint_source`)."""

    uri: str
    endpoint: str
    endpoint_source: str = ""
    checks: list[Check] = field(default_factory=list)
    plan: list[str] = field(default_factory=list)  # what s3ckpt will do on this store

    @property
    def exit_status(self) -> int:
        """0: s3ckpt will work; 1: it will, with a degraded feature; 2: it cannot."""
        statuses = {c.status for c in self.checks}
        return 2 if "failed" in statuses else 1 if "degraded" in statuses else 0
