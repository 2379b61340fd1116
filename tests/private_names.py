"""The internals of torch, Lightning, megatron-core, DeepSpeed, aiobotocore, botocore and
aiohttp are touched in one module each.

Every module of ``s3ckpt/`` is read with ``ast``; outside the compat module(s) allowed for
a dependency (:data:`COMPAT_MODULES`), each of these is reported as ``path:line: name``:

* an import of a private module or name (``from torch.distributed.checkpoint._x import y``,
  ``from botocore.x import _y``, ``import aiohttp._x``), or of one of the undocumented
  internals listed in :data:`INTERNALS` (``botocore.httpsession``...);
* an attribute starting with ``_`` (dunders aside) of a name bound by an import of one of
  those packages (``torch._C``, ``bce._x`` after ``from botocore import exceptions as bce``),
  also when read with ``getattr(name, "_x")``, and an internal reached as an attribute
  (``botocore.xform_name``);
* in a class whose bases are all classes of those packages, ``super()._x``, and ``self._x``
  where the class does not define ``_x`` itself (an attribute of the foreign base);
* a handler registered on botocore's event hooks (``client.meta.events.register``).

Names are resolved per module, without scopes: precise for how the package is written
(no module rebinds an imported name), and ``self._x`` and s3ckpt's own private names are
never foreign. ``make lint`` runs this file; ``tests/unit/test_architecture.py`` runs
:func:`violations` too.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "s3ckpt"

# The modules that may touch each dependency's internals, relative to the repository; an
# entry ending in "/" is a compat package, every module under it. Each one's docstring
# lists what it touches and why; keep this list short.
COMPAT_MODULES: dict[str, tuple[str, ...]] = {
    "torch": ("s3ckpt/dcp/compat/",),
    "lightning": ("s3ckpt/integrations/lightning/compat.py",),
    "botocore": ("s3ckpt/s3/compat_botocore.py",),
    "aiobotocore": ("s3ckpt/s3/compat_aiobotocore.py",),
    "aiohttp": (),  # s3ckpt touches none of aiohttp's internals (it reads aiobotocore's bodies)
    "megatron": ("s3ckpt/integrations/megatron/compat.py",),
    "deepspeed": ("s3ckpt/integrations/deepspeed/compat.py",),
}

# Modules and names that are internals though not marked private: the HTTP machinery under
# the clients. (aiohttp's public classes, its connectors and stream reader, are imported
# from ``aiohttp`` itself.)
INTERNALS = frozenset(
    {
        "botocore.awsrequest",
        "botocore.endpoint",
        "botocore.handlers",
        "botocore.hooks",
        "botocore.httpsession",
        "botocore.xform_name",
        "aiobotocore.awsrequest",
        "aiobotocore.endpoint",
        "aiobotocore.httpsession",
        "aiohttp.base_protocol",
        "aiohttp.client_proto",
        "aiohttp.client_reqrep",
        "aiohttp.connector",
        "aiohttp.http_parser",
        "aiohttp.http_writer",
    }
)

EVENT_HOOKS = frozenset({"register", "register_first", "register_last", "unregister"})


@dataclass(frozen=True, order=True)
class Violation:
    path: str  # relative to the repository
    line: int
    name: str
    dependency: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.name} ({self.dependency} internal)"


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def is_internal(qualified: str) -> bool:
    """Whether a dotted name is a private or listed internal of its package."""
    parts = qualified.split(".")
    if any(is_private(part) for part in parts):
        return True
    return any(".".join(parts[:n]) in INTERNALS for n in range(2, len(parts) + 1))


def dependency(qualified: str) -> str | None:
    top = qualified.split(".")[0]
    return top if top in COMPAT_MODULES else None


class _Module(ast.NodeVisitor):
    """The foreign internals one module's source touches."""

    def __init__(self, tree: ast.Module) -> None:
        self.bound = _foreign_bindings(tree)
        self.found: list[tuple[int, str]] = []

    def report(self, node: ast.AST, name: str) -> None:
        self.found.append((getattr(node, "lineno", 0), name))

    def qualified(self, node: ast.expr) -> str | None:
        """The dotted foreign name ``node`` refers to (``bce.SSLError`` ->
        ``botocore.exceptions.SSLError``), or None."""
        if isinstance(node, ast.Name):
            return self.bound.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.qualified(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if dependency(alias.name) and is_internal(alias.name):
                self.report(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module or not dependency(node.module):
            return
        for alias in node.names:
            name = f"{node.module}.{alias.name}"
            if is_internal(name):
                self.report(node, name)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        base = self.qualified(node.value)
        if base is not None and not is_internal(base) and is_internal(f"{base}.{node.attr}"):
            self.report(node, f"{base}.{node.attr}")
        if node.attr in EVENT_HOOKS and _is_meta_events(node.value):
            self.report(node, f"botocore event hook (meta.events.{node.attr})")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        """``getattr(name, "_x")`` (and ``hasattr``, ``setattr``)."""
        func, args = node.func, node.args
        if (
            isinstance(func, ast.Name)
            and func.id in ("getattr", "hasattr", "setattr")
            and len(args) >= 2
            and isinstance(args[1], ast.Constant)
            and isinstance(args[1].value, str)
            and is_private(args[1].value)
        ):
            base = self.qualified(args[0])
            if base is not None:
                self.report(node, f"{base}.{args[1].value}")
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = [self.qualified(base) for base in node.bases]
        if bases and all(base is not None for base in bases):
            own = _defined_in(node)
            for inner in ast.walk(node):
                if (
                    isinstance(inner, ast.Attribute)
                    and isinstance(inner.ctx, ast.Load)
                    and is_private(inner.attr)
                    and (
                        _is_super(inner.value) or (_is_self(inner.value) and inner.attr not in own)
                    )
                ):
                    self.report(inner, f"{bases[0]}.{inner.attr} (inherited by {node.name})")
        self.generic_visit(node)


def _foreign_bindings(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted foreign name an import binds it to, for the whole module."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if dependency(alias.name):
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:  # ``import a.b`` binds ``a``
                        top = alias.name.split(".")[0]
                        bound[top] = top
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and node.module
            and dependency(node.module)
        ):
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _is_meta_events(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "events"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "meta"
    )


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _is_super(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _defined_in(cls: ast.ClassDef) -> set[str]:
    """The attributes a class defines itself: methods, class attributes, ``self.x = ...``."""
    own: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and _is_self(node.value)
        ):
            own.add(node.attr)
    return own


def module_violations(source: str, path: str) -> Iterator[Violation]:
    """What ``source`` (the module at ``path``, relative to the repository) touches of
    foreign internals that its compat modules do not allow it."""
    tree = ast.parse(source, filename=path)
    visitor = _Module(tree)
    visitor.visit(tree)
    for line, name in visitor.found:
        dep = "botocore" if name.startswith("botocore event hook") else dependency(name)
        if dep is not None and not is_compat_module(path, dep):
            yield Violation(path, line, name, dep)


def is_compat_module(path: str, dep: str) -> bool:
    """Whether the module at ``path`` may touch ``dep``'s internals: one of its compat
    modules, or a module of one of its compat packages."""
    return any(
        path.startswith(allowed) if allowed.endswith("/") else path == allowed
        for allowed in COMPAT_MODULES[dep]
    )


def violations(package: Path = PACKAGE) -> list[Violation]:
    """Every violation in the modules under ``package``, in path and line order."""
    found: set[Violation] = set()
    for module in sorted(package.rglob("*.py")):
        path = module.relative_to(package.parent).as_posix()
        found.update(module_violations(module.read_text(), path))
    return sorted(found)


def main() -> int:
    found = violations()
    for violation in found:
        print(violation)
    if found:
        print(
            f"{len(found)} use(s) of {'/'.join(COMPAT_MODULES)} internals outside "
            "their compat modules (tests/private_names.py says which modules may)"
        )
        return 1
    print(f"{'/'.join(COMPAT_MODULES)} internals: only in their compat modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
