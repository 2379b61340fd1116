"""Sizes for people: the one way s3ckpt writes a number of bytes in logs, metrics' text,
doctor's report and the CLI.

Binary units throughout (``KiB``, ``MiB``, ``GiB``: what ``ls -h``, ``du -h`` and
``S3Config``'s own limits use), so a size s3ckpt prints matches the one a user's tools show
for the same bytes. Free of imports, so that anything may use it.
"""

from __future__ import annotations

_SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``: binary units, three significant digits, exact below 1 KiB
    (``12 B``, never ``0.0 MiB``); a value that would round to 1024 of a unit is shown as 1
    of the next."""
    value = max(0.0, float(n))
    if value < 1023.5:
        return f"{round(value)} B"
    for unit in _SIZE_UNITS[1:]:
        value /= 1024
        if value < 1023.5 or unit == _SIZE_UNITS[-1]:
            return f"{value:.3g} {unit}" if value < 999.5 else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def human_rate(bytes_per_second: float) -> str:
    """``75.6e6`` -> ``72.1 MiB/s``: :func:`human_bytes` per second."""
    return f"{human_bytes(bytes_per_second)}/s"


__all__ = ["human_bytes", "human_rate"]
