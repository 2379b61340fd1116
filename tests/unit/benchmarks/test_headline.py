"""benchmarks/headline.py: docs/performance.md's headline table, rendered from a results file
in the shape ``python -m benchmarks.run`` writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import headline


def _case(mbps: float, cpu: float, **extra: float) -> dict[str, float]:
    return {"mbps_median": mbps, "cpu_s_per_gib": cpu, **extra}


SAMPLE = {
    "report": {
        "size_mib": 1024,
        "reps": 3,
        "cases": {
            "memcpy": _case(8992, 0.1, seconds_median=0.12),
            "raw_upload": _case(148, 0.97),
            "s3ckpt_save": _case(169, 0.84),
            "s3ckpt_async": _case(130, 1.53, blocked_median_after_first_s=0.2),
            "s3torch_save": _case(126, 2.67),
            "fsspec_save": {"error": "s3fs failed"},
            "raw_download": _case(932, 0.68),
            "s3ckpt_load": _case(902, 0.62),
            "s3torch_load": {"skipped": "s3torchconnector not installed"},
            "filesystem_load": _case(1283, 1.2),
        },
        "targets": [],
    },
    "raw": {},
}


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    results = tmp_path / "bench.json"
    results.write_text(json.dumps(SAMPLE))
    page = tmp_path / "performance.md"
    page.write_text(
        f"# Performance\n\nabove\n\n{headline.START}\nold table\n{headline.END}\n\nbelow\n"
    )
    return results, page


def test_the_table_between_the_markers_is_rendered_from_the_results(files) -> None:
    results, page = files
    assert headline.main(["--results", str(results), "--page", str(page)]) == 0
    text = page.read_text()
    assert "old table" not in text
    assert text.startswith("# Performance\n\nabove\n\n" + headline.START + "\n")
    assert text.endswith(headline.END + "\n\nbelow\n")
    table = text.split(headline.START)[1].split(headline.END)[0]
    prose = " ".join(table.split())
    assert "`python -m benchmarks.run --size-mib 1024 --reps 3`" in prose
    assert headline.describe_machine() in prose
    assert all(len(line) <= 92 for line in table.splitlines() if not line.startswith("|"))
    rows = table.splitlines()
    assert "| raw multipart upload (ceiling) | 148 | 0.97 | 1.00 |" in rows
    assert "| **s3ckpt `dcp.save`** | 169 | 0.84 | 1.14 |" in rows
    assert "| s3torchconnector | 126 | 2.67 | 0.85 |" in rows
    assert "| FsspecWriter + s3fs | s3fs failed | | |" in rows
    assert "| FileSystemWriter, local disk | not run | | |" in rows
    assert "| **s3ckpt `dcp.load`** | 902 | 0.62 | 0.97 |" in rows
    assert "| s3torchconnector | s3torchconnector not installed | | |" in rows
    assert "| FileSystemReader, local disk | 1,283 | 1.20 | 1.38 |" in rows
    assert "blocked the caller 0.20 s a save from the second on, 1.67x a bare copy" in prose


def test_a_recorded_date_and_machine_are_kept_and_a_second_rendering_changes_nothing(
    files,
) -> None:
    results, page = files
    recorded = {**SAMPLE, "report": {**SAMPLE["report"], "date": "D", "machine": "M"}}
    results.write_text(json.dumps(recorded))
    headline.main(["--results", str(results), "--page", str(page)])
    once = page.read_text()
    assert f"{headline.START}\nD, M: `python -m benchmarks.run" in once
    headline.main(["--results", str(results), "--page", str(page)])
    assert page.read_text() == once


def test_a_page_without_the_markers_is_refused(files) -> None:
    results, page = files
    page.write_text("# Performance\n")
    with pytest.raises(ValueError, match="markers"):
        headline.main(["--results", str(results), "--page", str(page)])
    assert page.read_text() == "# Performance\n"


def test_docs_performance_md_holds_the_markers_once_each_in_order() -> None:
    text = headline.PAGE.read_text()
    assert text.count(headline.START) == 1
    assert text.count(headline.END) == 1
    assert text.index(headline.START) < text.index(headline.END)
