"""The fault matrix of ``docs/reliability.md``, from counts the test suite itself recorded.

``tests/integration/test_faults.py`` and ``test_crash.py`` count what they injected and
what came back, and :func:`record` stores each suite's rows in ``tests/.reliability/
results.json`` (ignored by git: a test run never rewrites a tracked file). :func:`update_doc`
renders them as a markdown table between the ``fault-matrix`` markers of the document, so
the numbers there are always ones a run produced, never typed by hand.
``make reliability-report`` runs both suites and then this module.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "tests" / ".reliability" / "results.json"
DOC = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- fault-matrix:begin -->", "<!-- fault-matrix:end -->"
SUITES = {
    "faults": "Fault proxy (`test_faults.py`)",
    "crash": "Crash trials (`test_crash.py`)",
    "replaced": "Overwrites during multi-rank loads (`test_replaced_during_load.py`)",
    "maintenance": "Maintenance next to saves (`test_maintenance_safety.py`)",
}


@dataclass
class Row:
    """One scenario: what was injected, and what became of the operations run through it."""

    scenario: str
    faults: dict[str, int]
    operations: int
    survived: int = 0  # completed, every byte compared equal
    failed_cleanly: int = 0  # failed with the right error, nothing visible, nothing damaged
    bytes_verified: int = 0
    bytes_lost: int = 0


@dataclass
class Suite:
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, row: Row) -> None:
        self.rows.append(row)


def filled(name: str, rows: int, notes: list[str]) -> Iterator[Suite]:
    """A suite for a test module's rows (a module-scoped fixture yields from this), recorded
    as ``name`` once it holds all ``rows``: a run of some of the tests records nothing."""
    suite = Suite(notes=notes)
    yield suite
    if len(suite.rows) == rows:
        record(name, suite)


def record(name: str, suite: Suite, results: Path = RESULTS) -> None:
    """Store one suite's rows (replacing its previous run), keeping the other suites'.

    Two test runs in one checkout (the main and the newest-torch environments, say) may
    record at once: the read and the write happen under a lock, and the file is replaced
    whole, so a reader never sees half of it and no run drops another's suite.
    """
    results.parent.mkdir(parents=True, exist_ok=True)
    with _locked(results):
        data = load(results)
        data[name] = {
            "recorded": time.strftime("%Y-%m-%d %H:%M:%S"),
            "rows": [asdict(r) for r in suite.rows],
            "notes": suite.notes,
        }
        partial = results.with_name(f"{results.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(data, indent=2) + "\n")
        partial.replace(results)


@contextlib.contextmanager
def _locked(results: Path) -> Iterator[None]:
    with results.with_name(results.name + ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load(results: Path = RESULTS) -> dict[str, Any]:
    return json.loads(results.read_text()) if results.exists() else {}


def render(data: dict[str, Any]) -> str:
    """The markdown for the recorded suites: one table each, then their notes."""
    out: list[str] = []
    for name, title in SUITES.items():
        suite = data.get(name)
        if suite is None:
            out += [f"**{title}**: not recorded yet.", ""]
            continue
        out += [f"**{title}**, recorded {suite['recorded']}:", "", *_table(suite["rows"]), ""]
        out += [f"- {note}" for note in suite["notes"]]
        out += [""] if suite["notes"] else []
    return "\n".join(out).rstrip() + "\n"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| Scenario | Faults injected | Operations | Survived bit-exact | Failed cleanly "
        "| Bytes verified | Bytes lost |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    total = Row("**total**", {}, 0)
    for raw in rows:
        row = Row(**raw)
        lines.append(_line(row))
        for kind, count in row.faults.items():
            total.faults[kind] = total.faults.get(kind, 0) + count
        total.operations += row.operations
        total.survived += row.survived
        total.failed_cleanly += row.failed_cleanly
        total.bytes_verified += row.bytes_verified
        total.bytes_lost += row.bytes_lost
    return [*lines, _line(total)]


def _line(row: Row) -> str:
    faults = ", ".join(f"{kind} {n}" for kind, n in sorted(row.faults.items())) or "none"
    return (
        f"| {row.scenario} | {faults} | {row.operations} | {row.survived} | "
        f"{row.failed_cleanly} | {row.bytes_verified:,} | {row.bytes_lost} |"
    )


def update_doc(doc: Path = DOC, results: Path = RESULTS) -> bool:
    """Replace the text between the markers of ``doc``; True if it changed."""
    text = doc.read_text()
    head, found, rest = text.partition(BEGIN)
    _, found_end, tail = rest.partition(END)
    if not (found and found_end):
        raise ValueError(f"{doc} lacks the {BEGIN} / {END} markers")
    updated = f"{head}{BEGIN}\n{render(load(results))}{END}{tail}"
    if updated != text:
        doc.write_text(updated)
    return updated != text


if __name__ == "__main__":
    print(f"{DOC.relative_to(ROOT)}: {'updated' if update_doc() else 'unchanged'}")
