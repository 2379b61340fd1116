"""The API reference (docs/reference) builds from the public API's docstrings, as ``make docs``
builds it: warnings are errors, so a broken cross reference or a docstring docutils rejects
fails here; and every name of each documented module's ``__all__`` has its entry."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

# The checkout's root: the folder above this file that holds pyproject.toml.
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
REFERENCE = ROOT / "docs" / "reference"


def _conf():
    """docs/reference/conf.py as a module: the list of documented modules and their names."""
    spec = importlib.util.spec_from_file_location("s3ckpt_reference_conf", REFERENCE / "conf.py")
    assert spec is not None and spec.loader is not None
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    return conf


@pytest.mark.subprocess
def test_reference_builds_without_a_warning_and_documents_every_exported_name(tmp_path):
    out = tmp_path / "html"
    sphinx = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q"]
    built = subprocess.run(
        [*sphinx, str(REFERENCE), str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    problems = [
        line for line in built.stderr.splitlines() if "WARNING:" in line or "ERROR:" in line
    ]
    assert problems == [], "\n".join(problems)
    assert built.returncode == 0, built.stderr

    pages = "".join(page.read_text() for page in out.glob("*.html"))
    conf = _conf()
    assert conf.DOCUMENTED_MODULES
    for module in conf.DOCUMENTED_MODULES:
        assert f'id="module-{module}"' in pages, module
        names = conf.exported_names(module)
        assert names, module
        missing = [name for name in names if f'id="{module}.{name}"' not in pages]
        assert missing == [], f"{module}: {missing} have no entry in the reference"
