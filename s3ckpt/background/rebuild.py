"""What the checkpoint process can rebuild of a state, checked before the state is copied.

The checkpoint process unpickles each save's state in a fresh interpreter that runs
:mod:`s3ckpt.background.process_side`, never the training script. Pickle writes a class or a
function by name (its module and qualified name), so that process cannot rebuild:

* a class or function of the trainer's ``__main__`` (there, ``__main__`` is the worker):
  ``save()`` would return and the save fail in the background with "Can't get attribute";
* a class or function defined inside a function (``<locals>``) and a lambda, which pickle
  refuses in the trainer already;
* one of a module that no import finds (a module made at run time, no ``__spec__``);
* anything else pickle refuses (a lock, an open file).

:meth:`ChildImports.check` pickles, into nothing, only the values a stage neither walks
(dicts, lists, tuples) nor copies (tensors) nor knows plain (numbers, strings, bytes,
``None``), tensors inside them as placeholders: for an ordinary state the whole cost is
one set look-up per such value while the stage walks it. A value that fails is named
by its path in the state (``extra.obj``) in an
:class:`~s3ckpt.errors.UnpicklableStateError`, raised by ``save()`` before anything is
copied or sent, so nothing is uploaded and the next save goes on as usual.
"""

from __future__ import annotations

import importlib.util
import pickle
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

from s3ckpt.errors import UnpicklableStateError

PLAIN_VALUES = frozenset({int, float, bool, str, bytes, complex, type(None)})
_CODE = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.MethodDescriptorType,
)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_PLAIN_DATA = "convert the value to plain data (numbers, strings, lists, dicts, tensors)"
_REMEDY = (
    "the checkpoint process rebuilds the state from pickled names in a fresh interpreter: "
    f"define the class or function in a module it can import, or {_PLAIN_DATA}"
)


class ChildImports:
    """What the checkpoint process can import, as far as its pickles need (one per
    checkpoint process): the modules found importable are kept, so each is looked up
    once."""

    def __init__(self) -> None:
        self._importable: set[str] = set()

    def check(self, values: list[Any], state: Any) -> None:
        """Raise :class:`~s3ckpt.errors.UnpicklableStateError` for the first of
        ``values`` (leaves of ``state``) the checkpoint process could not rebuild."""
        if not values:
            return
        checker = _Checker(self)
        for value in values:
            try:
                checker.dump(value)
            except _Refused as refused:
                hint = _IN_PROCESS if _MAIN in str(refused) else ""
                _raise(state, value, f"{refused}: not saved; {_REMEDY}{hint}", refused)
            except Exception as exc:  # what pickle itself refuses
                text = str(exc).splitlines()[0] if str(exc) else ""
                reason = f"cannot be pickled ({type(exc).__name__}: {text}): not saved; "
                _raise(state, value, reason + _PLAIN_DATA, exc)

    def why_not(self, module: str) -> str | None:
        """Why the checkpoint process cannot import ``module``; None if it can."""
        if module in self._importable:
            return None
        why = _why_not(module)
        if why is None:
            self._importable.add(module)
        return why


_MAIN = "of __main__ (the script), which the checkpoint process does not run"
_IN_PROCESS = "; or save with async_mode='thread', which keeps the state in this process"


def _why_not(module: str) -> str | None:
    if module == "__main__":
        return _MAIN
    loaded = sys.modules.get(module)
    top = module.partition(".")[0]
    if loaded is not None and getattr(loaded, "__spec__", None) is None and top == module:
        return f"of module {module!r}, made at run time: no import finds it"
    if top in sys.modules or top in sys.builtin_module_names:
        return None
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        found = None
    return None if found is not None else f"of module {module!r}, which no import finds"


class _Refused(pickle.PicklingError):
    """A class or function the checkpoint process could not rebuild."""


class _Sink:
    def write(self, data: bytes) -> int:
        return len(data)


class _Checker(pickle.Pickler):
    """Pickles into nothing, refusing what the checkpoint process could not rebuild."""

    def __init__(self, imports: ChildImports) -> None:
        super().__init__(_Sink(), protocol=pickle.HIGHEST_PROTOCOL)
        self._imports = imports
        self._seen: set[int] = set()  # classes and functions already judged

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):  # its bytes are the stage's: a placeholder here
            if type(obj) not in _PLAIN_TENSORS:
                self._judge(type(obj))
            return 0
        if isinstance(obj, (torch.UntypedStorage, torch.storage.TypedStorage)):
            return 0
        if isinstance(obj, (type, *_CODE)):
            self._judge(obj)
        return None

    def _judge(self, obj: Any) -> None:
        if id(obj) in self._seen:
            return
        module = getattr(obj, "__module__", None)
        name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "?")
        what = "class" if isinstance(obj, type) else "function"
        if "<lambda>" in name:
            raise _Refused(f"holds a lambda ({module}.{name})")
        if "<locals>" in name:
            raise _Refused(f"holds {what} {name!r}, defined inside a function")
        if isinstance(module, str):
            why = self._imports.why_not(module)
            if why is not None:
                raise _Refused(f"holds {what} {name!r} {why}")
        self._seen.add(id(obj))


def _raise(state: Any, value: Any, reason: str, cause: Exception) -> None:
    key = path_of(state, value)
    where = f"state key {key!r}" if key is not None else "a value of the state"
    raise UnpicklableStateError(f"{where} {reason}", key) from cause


def path_of(state: Any, value: Any) -> str | None:
    """The path of ``value`` in ``state`` (``extra.items.0``), found by identity."""
    for path, leaf in _leaves(state, ()):
        if leaf is value:
            return ".".join(path)
    return None


def _leaves(value: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every leaf of ``value`` with its path, walked as the stage walks it."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, str(key)))
    elif isinstance(value, list) or type(value) is tuple:
        for index, item in enumerate(value):
            yield from _leaves(item, (*path, str(index)))
    else:
        yield path, value
