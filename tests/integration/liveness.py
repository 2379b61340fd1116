"""Whether a process is alive, read from ``/proc``: a zombie (exited, not yet reaped) is not."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int | None) -> bool:
    """``pid`` names a process that has not exited (``None``: no process)."""
    if pid is None:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False
