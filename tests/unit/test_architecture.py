"""The walls between the parts of the package hold, and breaking one fails the check.

The import contracts live in ``pyproject.toml`` (``[tool.importlinter]``) and are checked
by import-linter, here and in ``make lint``. import-linter sees external packages only by
their top-level name (``torch``), so the finer rule, that only the DCP adapters know DCP's
planner and metadata types, is checked here by reading the imports of every module.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "s3ckpt"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

# DCP's planner-facing modules: what a storage adapter, and nothing else, deals with.
DCP_INTERNALS = (
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.storage",
    "torch.distributed.checkpoint.default_planner",
)
ADAPTERS = "s3ckpt.dcp"


def _lint_imports(package_parent: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=package_parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy_of_package(tmp_path: Path) -> Path:
    shutil.copytree(
        PACKAGE, tmp_path / "s3ckpt", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    return tmp_path


@pytest.mark.subprocess  # runs lint-imports
def test_the_import_contracts_hold() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.subprocess  # runs lint-imports
@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        (
            "s3/retry.py",
            "import torch",
            "The S3 transport, the transfer engine and the format import no torch",
        ),
        ("catalog/scan.py", "import s3ckpt.dcp.compat", "The catalog and the CLI import no torch"),
        ("transfer/upload.py", "from s3ckpt.testing import local_s3", "the embedded server"),
        (
            "format/layout.py",
            "from s3ckpt.transfer import parts",
            "Applications over adapters over the engine",
        ),
        # The CLI may reach torch only through export and import, from its interop module.
        (
            "cli/commands.py",
            "from s3ckpt.interop import export",
            "The catalog and the CLI import no torch",
        ),
        ("interop/copy.py", "import torch", "Copying checkpoints imports no torch"),
        (
            "interop/objects.py",
            "from s3ckpt.interop import export",
            "Copying checkpoints imports no torch",
        ),
        (
            "catalog/verify.py",
            "from s3ckpt.interop import copy",
            "Applications over adapters over the engine",
        ),
    ],
)
def test_a_crossing_import_breaks_a_contract(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    copy = _copy_of_package(tmp_path)
    target = copy / "s3ckpt" / module
    target.write_text(target.read_text() + f"\n{line}  # crossing\n")
    result = _lint_imports(copy)
    assert result.returncode != 0, result.stdout
    report = " ".join(result.stdout.split())  # long contract names wrap
    verdict = report[report.index(contract) :].split(" BROKEN")[0]
    assert " KEPT" not in verdict, result.stdout


def dcp_internal_imports(source: str) -> list[str]:
    """The DCP planner-facing modules ``source`` imports (``import x``, ``from x import y``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [n for n in names if n.startswith(DCP_INTERNALS)]
    return found


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_only_the_dcp_adapters_know_dcps_planner_types() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        if name == ADAPTERS or name.startswith(ADAPTERS + "."):
            continue
        found = dcp_internal_imports(path.read_text())
        if found:
            offenders[name] = found
    assert offenders == {}


def test_the_planner_type_check_sees_every_form_of_import() -> None:
    assert dcp_internal_imports("from torch.distributed.checkpoint.planner import SavePlanner")
    assert dcp_internal_imports("import torch.distributed.checkpoint.metadata as m")
    assert dcp_internal_imports("from torch.distributed.checkpoint import storage")
    assert dcp_internal_imports(
        "def f():\n    from torch.distributed.checkpoint.storage import StorageWriter"
    )
    assert not dcp_internal_imports("import torch.distributed.checkpoint as dcp")
    assert not dcp_internal_imports(
        "from torch.distributed.checkpoint.staging import DefaultStager"
    )
