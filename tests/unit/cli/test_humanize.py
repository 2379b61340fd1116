"""Human output (sizes, durations, tables), duration parsing, and the progress reporter."""

from __future__ import annotations

import io
import time

import pytest

from s3ckpt.catalog.reporting import SILENT
from s3ckpt.cli.humanize import (
    format_time,
    human_bytes,
    human_duration,
    iso_time,
    parse_duration,
    table,
)
from s3ckpt.cli.progress import Progress
from s3ckpt.errors import ConfigError


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (10 * 1024**2 + 1, "10 MiB"),
        (int(1.25 * 1024**3), "1.25 GiB"),
        (999 * 1024**4, "999 TiB"),
        (1000 * 1024**4, "1000 TiB"),
        (3 * 1024**6, "3 EiB"),
    ],
)
def test_human_bytes(n, text):
    assert human_bytes(n) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-5, "0s"),
        (59.9, "59s"),
        (60, "1m"),
        (61, "1m 1s"),
        (3600, "1h"),
        (9000, "2h 30m"),
        (86400 + 59, "1d"),
        (3 * 86400 + 4 * 3600 + 5, "3d 4h"),
    ],
)
def test_human_duration(seconds, text):
    assert human_duration(seconds) == text


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30), ("15m", 900), ("1h", 3600), ("7d", 604800), ("2w", 1209600), ("1.5h", 5400)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "7", "d", "7y", "-1h", "1h30m", "one hour"])
def test_parse_duration_refuses_anything_else(text):
    with pytest.raises(ConfigError, match="invalid duration"):
        parse_duration(text)


def test_times():
    assert iso_time(0) == "1970-01-01T00:00:00Z"
    assert iso_time(None) is None
    assert format_time(None) == "-"
    assert format_time(time.mktime((2024, 5, 1, 12, 0, 3, 0, 0, -1))) == "2024-05-01 12:00:03"


def test_table_aligns_columns_and_right_aligns_numbers():
    text = table(["NAME", "SIZE"], [["step-1", "1 KiB"], ["step-100", "12.5 MiB"]], right=[1])
    assert text.splitlines() == [
        "NAME          SIZE",
        "step-1       1 KiB",
        "step-100  12.5 MiB",
    ]


def test_table_shows_none_as_a_dash_and_strips_trailing_spaces():
    assert table(["A", "B"], [["x", None], ["long", ""]]).splitlines() == [
        "A     B",
        "x     -",
        "long",
    ]


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_a_bar_on_a_terminal():
    stream = FakeTTY()
    progress = Progress(stream)
    progress.interval = 0
    progress.start("verifying", 4 * 1024**2, "bytes")
    progress.advance(1024**2)
    progress.advance(3 * 1024**2)
    progress.finish()
    out = stream.getvalue()
    assert out.startswith("\r[#######") and "verifying: 1 MiB/4 MiB (25%)" in out
    assert "4 MiB/4 MiB (100%)" in out and out.endswith("\n")


def test_progress_writes_plain_lines_elsewhere():
    stream = io.StringIO()
    progress = Progress(stream, interval=0)
    progress.start("deleting objects", 2000, "objects")
    progress.advance(1000)
    progress.advance(1000)
    progress.finish()
    assert stream.getvalue().splitlines() == [
        "s3ckpt: deleting objects: 1000 objects/2000 objects (50%)",
        "s3ckpt: deleting objects: 2000 objects/2000 objects (100%)",
    ]


def test_short_operations_print_nothing():
    stream = io.StringIO()
    progress = Progress(stream, interval=60)
    progress.start("verifying", 10, "bytes")
    progress.advance(10)
    progress.finish()
    assert stream.getvalue() == ""
    SILENT.start("x", 1, "bytes")
    SILENT.advance(1)
    SILENT.finish()
