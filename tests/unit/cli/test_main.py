"""The CLI's small promises: ``--version``, the ``--json`` failure document, one size format
(binary units, from ``s3ckpt.units``) in the CLI and the manager's log line, and tables
that stay aligned with wide (CJK) characters."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from s3ckpt import _version
from s3ckpt.cli.humanize import display_width, human_bytes, table
from s3ckpt.cli.main import main, wants_json
from s3ckpt.manager.policy import SaveMetrics
from s3ckpt.units import human_rate

# -- sizes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (12, "12 B"),
        (1023, "1023 B"),
        (1023.6, "1 KiB"),  # rounds up into the next unit, never "1024 B"
        (3174, "3.1 KiB"),
        (999.5 * 1024, "1000 KiB"),  # not "1e+03 KiB"
        (1023.9 * 1024, "1 MiB"),
        (75_600_000, "72.1 MiB"),  # what ls -h says of 75.6 MB
        (-1, "0 B"),
    ],
)
def test_sizes_are_binary_and_small_ones_exact(n, text):
    assert human_bytes(n) == text


def test_rates_use_the_same_units():
    assert human_rate(75_600_000) == "72.1 MiB/s"
    assert human_rate(100) == "100 B/s"


def test_the_managers_log_line_uses_binary_units():
    big = str(SaveMetrics.of(7, 0.25, 2.0, 75_600_000, 0.0))
    assert "committed: 72.1 MiB," in big and "(36 MiB/s)" in big
    assert " MB" not in big
    small = str(SaveMetrics.of(8, 0.01, 0.5, 12, 0.0))
    assert "committed: 12 B," in small and "0.0" not in small.split("blocked")[0]
    held = str(SaveMetrics.of(9, 0.01, 0.0, 3174, 0.0, held_s=0.1, to_s3=False))
    assert "held in memory: 3.1 KiB on this rank" in held


# -- wide characters -----------------------------------------------------------------------


def test_display_width_counts_wide_and_fullwidth_characters_twice():
    assert display_width("step-1") == 6
    assert display_width("模型") == 4  # East Asian Wide
    assert display_width("\uff21\uff22") == 4  # Fullwidth
    assert display_width("e\u0301") == 1  # a combining accent takes no column
    assert display_width("ｶﾀ") == 2  # Halfwidth katakana: one column each


def _last_cell_column(line: str) -> int:
    """The terminal column where a line's last cell starts (cells are two spaces apart)."""
    index = line.rstrip().rindex("  ") + 2
    while line[index] == " ":
        index += 1
    return display_width(line[:index])


def test_tables_align_names_in_any_script():
    rows = [["step-1", "1 KiB"], ["模型-步骤-2", "12.5 MiB"], ["\uff26\uff35\uff2c\uff2c", "3 GiB"]]
    lines = table(["NAME", "SIZE"], rows, right=[1]).splitlines()
    ends = {display_width(line) for line in lines}
    assert len(ends) == 1, lines  # right-aligned sizes end in one terminal column
    lefts = table(["NAME", "SIZE"], rows).splitlines()
    starts = {_last_cell_column(line) for line in lefts}
    assert len(starts) == 1, lefts  # left-aligned sizes start in one terminal column


# -- --version -----------------------------------------------------------------------------


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"s3ckpt {_version.__version__}\n"


@pytest.mark.subprocess
def test_the_installed_command_prints_its_version():
    command = shutil.which("s3ckpt", path=str(Path(sys.executable).parent))
    assert command is not None, "the s3ckpt console script is not installed beside python"
    result = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == f"s3ckpt {_version.__version__}\n"


# -- --json failures -----------------------------------------------------------------------


def _failure(capsys, argv: list[str]) -> tuple[int, dict[str, object], str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, json.loads(out), err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["ls", "--json"], "required: S3_URI"),  # a missing argument
        (["ls", "s3://ckpt/run", "--json", "--bogus"], "unrecognized arguments: --bogus"),
        (["ls", "s3://ckpt/run", "--json", "--timeout", "1x"], "invalid duration '1x'"),
        (["prune", "s3://ckpt/run", "--js"], "required: --keep-last"),  # an abbreviation
        (["ls", "not-a-uri", "--json"], "expected an s3://bucket/prefix URI"),
        (["ls", "s3://ckpt/run", "--json", "--ca-bundle", "/no/such/ca.pem"], "no such file"),
        (["gc", "s3://ckpt/run", "--older-than", "1m", "--json"], "pass --force"),  # a refusal
    ],
)
def test_json_failures_are_a_json_document_on_stdout(capsys, argv, words):
    code, document, err = _failure(capsys, argv)
    assert code == 2 and document == {"error": document["error"], "exit": 2}
    assert words in str(document["error"])
    assert err.count("\n") == 1 and "error:" in err and words in err  # stderr as before


def test_a_problem_found_is_exit_1_in_json_too(capsys, tmp_path):
    code, document, err = _failure(
        capsys, ["import", str(tmp_path), "s3://ckpt/run/step-1", "--json",
                 "--endpoint-url", "http://127.0.0.1:9"],
    )  # fmt: skip
    assert code == 1 and document["exit"] == 1
    assert "is not a checkpoint folder" in str(document["error"]) and "import: error:" in err


def test_without_json_stdout_stays_empty(capsys):
    with pytest.raises(SystemExit):
        main(["ls"])
    out, err = capsys.readouterr()
    assert out == "" and "required: S3_URI" in err


@pytest.mark.parametrize(
    ("argv", "wanted"),
    [
        (["ls", "s3://a/b", "--json"], True),
        (["ls", "--js", "s3://a/b"], True),
        (["ls", "s3://a/b"], False),
        (["ls", "--", "--json"], False),  # after "--", an argument, not the option
        (["ls", "--jsonx"], False),
    ],
)
def test_json_is_recognised_before_parsing(argv, wanted):
    assert wants_json(argv) is wanted
