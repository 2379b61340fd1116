"""The walls between the parts of the package hold, and breaking one fails the check.

The import contracts live in ``pyproject.toml`` (``[tool.importlinter]``) and are checked
by import-linter, here and in ``make lint``. import-linter sees external packages only by
their top-level name (``torch``), so the finer rule, that only the DCP adapters know DCP's
planner and metadata types, is checked here by reading the imports of every module, and
so is the rule that only their compat modules touch the internals of torch, aiobotocore,
botocore and aiohttp (``tests/private_names.py``, also run by ``make lint``).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import private_names
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
        ("s3/get_attempt.py", "import h11", "Only the data plane (s3ckpt.s3.wire) parses HTTP"),
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


# -- foreign internals only in their compat modules (tests/private_names.py, make lint) ----


def test_private_names_of_dependencies_are_touched_only_in_their_compat_modules() -> None:
    found = private_names.violations()
    assert not found, "\n".join(str(v) for v in found)


@pytest.mark.parametrize(
    ("source", "name"),
    [
        (
            "from torch.distributed.checkpoint._state_dict_stager import StateDictStager",
            "torch.distributed.checkpoint._state_dict_stager.StateDictStager",
        ),
        ("from botocore.endpoint import _x", "botocore.endpoint._x"),
        ("import aiohttp._http_parser", "aiohttp._http_parser"),
        ("from torch.distributed import checkpoint as c\nc._x", "torch.distributed.checkpoint._x"),
        ("import torch\ntorch._C._foo()", "torch._C"),
        ("import torch.distributed as dist\ndist._functional", "torch.distributed._functional"),
        ("from botocore import exceptions as bce\nbce._private", "botocore.exceptions._private"),
        ("import torch\ngetattr(torch, '_dynamo')", "torch._dynamo"),
        ("from botocore.httpsession import get_cert_path", "botocore.httpsession.get_cert_path"),
        (
            "from aiobotocore.awsrequest import AioAWSResponse",
            "aiobotocore.awsrequest.AioAWSResponse",
        ),
        ("import botocore\nbotocore.xform_name('HeadObject')", "botocore.xform_name"),
        ("def f():\n    from botocore import xform_name", "botocore.xform_name"),
        ("client.meta.events.register('before-send.s3.PutObject', f)", "botocore event hook"),
        (
            "from aiohttp.payload import BytesPayload\n"
            "class Body(BytesPayload):\n"
            "    def __len__(self):\n"
            "        return self._size",
            "aiohttp.payload.BytesPayload._size",
        ),
        (
            "from aiohttp import payload\n"
            "class Body(payload.BytesPayload):\n"
            "    def write(self):\n"
            "        return super()._write()",
            "aiohttp.payload.BytesPayload._write",
        ),
    ],
)
def test_private_names_check_sees_every_form(source: str, name: str) -> None:
    found = list(private_names.module_violations(source, "s3ckpt/s3/store.py"))
    assert [v.name.split(" (")[0] for v in found] == [name], found
    assert str(found[0]).startswith(f"s3ckpt/s3/store.py:{found[0].line}: {name}")


def test_private_names_check_leaves_own_and_public_names_alone() -> None:
    source = (
        "import sys\n"
        "import torch\n"
        "from botocore import exceptions as bce\n"
        "from aiohttp.payload import BytesPayload\n"
        "from s3ckpt.s3.wire.exchange import _dropped\n"
        "from ._version import __version__\n"
        "torch.__version__, bce.ClientError, sys._getframe(0), _dropped()\n"
        "class Body(BytesPayload):\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n"
        "    def _helper(self):\n"
        "        return self._mine\n"
        "    def size(self):\n"
        "        return self._helper()\n"
        "class Store(Base):\n"
        "    def get(self):\n"
        "        return self._client, super()._request()\n"
    )
    assert list(private_names.module_violations(source, "s3ckpt/s3/store.py")) == []


def test_private_names_are_allowed_in_their_own_compat_module_only() -> None:
    source = "import torch\nfrom botocore import xform_name\ntorch._C"
    found = private_names.module_violations(source, "s3ckpt/dcp/compat/__init__.py")
    assert [v.dependency for v in found] == ["botocore"]
    found = private_names.module_violations(source, "s3ckpt/dcp/compat/tensors.py")
    assert [v.dependency for v in found] == ["botocore"]
    found = private_names.module_violations(source, "s3ckpt/dcp/compatible.py")
    assert sorted(v.dependency for v in found) == ["botocore", "torch"]
    found = private_names.module_violations(source, "s3ckpt/s3/compat_botocore.py")
    assert [v.dependency for v in found] == ["torch"]
