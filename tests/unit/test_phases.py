"""The Makefile's newest-torch phase: every folder of unit tests is placed.

The phase reruns the unit tests of the packages that use torch, and those of the other
folders that use torch themselves (``USES_TORCH``, found by grep); a new folder in neither
list would silently not run on the newest release.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "tests" / "unit"


def _listed(name: str) -> set[str]:
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    value = re.search(rf"^{name} := (.*)$", text, re.M)
    assert value is not None, name
    words = value.group(1).split()
    return {word for word in words if word.startswith("tests/unit/") and "*" not in word}


def test_every_unit_test_folder_is_in_one_list_of_the_newest_phase() -> None:
    torch_free, newest = _listed("TORCH_FREE_UNIT"), _listed("NEWEST_UNIT")
    folders = {
        f"tests/unit/{path.name}"
        for path in UNIT.iterdir()
        if path.is_dir() and any(path.rglob("test_*.py"))
    }
    assert not torch_free & newest
    assert folders == torch_free | newest


def test_the_modules_that_use_torch_in_the_torch_free_folders_are_found() -> None:
    text = (ROOT / "Makefile").read_text()
    uses_torch = re.search(r"^USES_TORCH := (.*)$", text, re.M)
    assert uses_torch is not None
    pattern = re.compile(uses_torch.group(1), re.M)
    for folder in _listed("TORCH_FREE_UNIT"):
        for module in (ROOT / folder).rglob("test_*.py"):
            source = module.read_text()
            if re.search(r"^(import torch|from torch)", source, re.M):
                assert pattern.search(source), module
