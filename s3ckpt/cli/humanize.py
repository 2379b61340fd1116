"""Human-readable output for the CLI: sizes, durations, times, aligned tables.

Kept apart from the commands so that every rendering rule is unit-tested once, and free of
third-party imports so that ``s3ckpt ls`` starts instantly. Durations are parsed here too
(``--older-than 7d``), with the same units they are printed in.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

from s3ckpt.errors import ConfigError

_SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")


def human_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB``: binary units, three significant digits, exact below 1 KiB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in _SIZE_UNITS[1:]:
        value /= 1024
        if value < 1024 or unit == _SIZE_UNITS[-1]:
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    """``9000`` -> ``2h 30m``: the largest unit and the next one if non-zero, floored."""
    remaining = max(0, int(seconds))
    counts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, remaining = divmod(remaining, size)
        counts.append((count, unit))
    first = next((i for i, (count, _) in enumerate(counts) if count), len(counts) - 1)
    shown = [f"{c}{u}" for c, u in counts[first : first + 2] if c]
    return " ".join(shown) or "0s"


def parse_duration(text: str) -> float:
    """``30s``, ``15m``, ``1h``, ``7d``, ``2w`` -> seconds; anything else is a ConfigError."""
    match = _DURATION_RE.match(text)
    if not match:
        raise ConfigError(
            f"invalid duration {text!r}: expected a number and a unit, one of s, m, h, d, w "
            "(e.g. 30s, 15m, 1h, 7d, 2w)"
        )
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def format_time(epoch: float | None) -> str:
    """Local wall-clock time to the second, the way an operator compares it with ``date``."""
    if epoch is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def iso_time(epoch: float | None) -> str | None:
    """UTC ISO 8601 with a ``Z``, for ``--json`` output that scripts parse."""
    if epoch is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], right: Sequence[int] = ()
) -> str:
    """Columns padded to their widest cell, two spaces apart; ``right`` lists right-aligned columns.

    Trailing spaces are stripped so the output diffs and greps cleanly.
    """
    cells = [[str(h) for h in headers], *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        padded = [
            value.rjust(width) if i in right else value.ljust(width)
            for i, (value, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def _cell(value: object) -> str:
    return "-" if value is None else str(value)
