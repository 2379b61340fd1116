"""Sphinx configuration of s3ckpt's API reference, generated from the public API's docstrings.

Built by ``make docs`` (and by tests/unit/test_api_reference.py) with warnings as errors, so a
broken reference fails. The pages only point autodoc at modules: the signatures, the options and
their documentation come from the code.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ast
import importlib
import importlib.util

from s3ckpt import __version__

# The modules the pages point autodoc at; each documents the names of its ``__all__``.
REFERENCE_ROOT = Path(__file__).resolve().parents[2]
DOCUMENTED_MODULES = [
    "s3ckpt",
    "s3ckpt.catalog",
    "s3ckpt.interop",
    "s3ckpt.integrations.lightning",
    "s3ckpt.integrations.megatron",
    "s3ckpt.integrations.deepspeed",
    "s3ckpt.integrations.torch_checkpointing",
]


def exported_names(module: str) -> list[str]:
    """The ``__all__`` of a package, read from its source (importing it may need an extra)."""
    source = REFERENCE_ROOT.joinpath(*module.split("."), "__init__.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise ValueError(f"{module} has no __all__")


EXPORTED = {name for module in DOCUMENTED_MODULES for name in exported_names(module)}

# s3ckpt, its catalog and interop resolve most names on first access (PEP 562,
# s3ckpt/_lazy.py), which autodoc's look at a module's namespace would miss: each name is
# resolved here first, so a name in ``__all__`` that does not resolve fails the build.
for module_name in DOCUMENTED_MODULES[:3]:
    module = importlib.import_module(module_name)
    for name in module.__all__:
        getattr(module, name)

project = "s3ckpt"
release = __version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
root_doc = "index"
exclude_patterns = ["_build"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
# The trainer frameworks are optional extras (DeepSpeed, an sdist, lives in an environment of
# its own: make test). Where one is not installed, its integration is documented over a stand-in
# of the framework (docstrings and functions' signatures stay; a class built on one of the
# framework's shows a generic signature): the reference builds in every environment the suite
# runs in.
TRAINER_FRAMEWORKS = ["deepspeed", "lightning", "megatron", "torch_checkpointing"]
autodoc_mock_imports = [
    name for name in TRAINER_FRAMEWORKS if importlib.util.find_spec(name) is None
]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# S3Config groups its options under these headings, each a list of ``name: meaning``.
napoleon_custom_sections = [
    ("Connection", "params_style"),
    ("Transfers", "params_style"),
    ("Retries", "params_style"),
]

html_theme = "alabaster"
html_title = f"s3ckpt {release} API reference"


def _document_every_exported_name(app, what, name, obj, skip, options):
    """Keep each name of a documented module's ``__all__``, a docstring or not."""
    if what == "module" and name in EXPORTED:
        return False
    return None


def _drop_a_constants_type_docstring(app, what, name, obj, options, lines):
    """A constant (``__version__``, ``LATEST``) is shown by its value, not its type's docstring."""
    if what == "data" and lines and type(obj).__doc__ and lines[0] in type(obj).__doc__:
        lines.clear()


def setup(app):
    app.connect("autodoc-skip-member", _document_every_exported_name)
    app.connect("autodoc-process-docstring", _drop_a_constants_type_docstring)
