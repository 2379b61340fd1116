"""Human-readable output for the CLI: sizes, durations, times, aligned tables.

Kept apart from the commands so that every rendering rule is unit-tested once, and free of
third-party imports so that ``s3ckpt ls`` starts instantly. Durations are parsed here too
(``--older-than 7d``), with the same units they are printed in. Sizes are
:func:`s3ckpt.units.human_bytes`, the one size format of logs and the CLI alike.
"""

from __future__ import annotations

import re
import time
import unicodedata
from collections.abc import Sequence

from s3ckpt.errors import ConfigError
from s3ckpt.units import human_bytes

__all__ = [
    "display_width",
    "format_time",
    "human_bytes",
    "human_duration",
    "iso_time",
    "parse_duration",
    "table",
]

_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")


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

    Widths are what a terminal shows (:func:`display_width`: a CJK character takes two
    columns), so names in any script line up. Trailing spaces are stripped so the output
    diffs and greps cleanly.
    """
    cells = [[str(h) for h in headers], *[[_cell(v) for v in row] for row in rows]]
    widths = [max(display_width(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        padded = []
        for i, (value, width) in enumerate(zip(row, widths, strict=True)):
            fill = " " * (width - display_width(value))
            padded.append(fill + value if i in right else value + fill)
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def display_width(text: str) -> int:
    """The columns ``text`` takes on a terminal: East Asian Wide and Fullwidth characters
    two, combining marks and other zero-width characters none, every other one."""
    return sum(_char_width(c) for c in text)


def _char_width(char: str) -> int:
    if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def _cell(value: object) -> str:
    return "-" if value is None else str(value)
