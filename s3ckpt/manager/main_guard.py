"""Process-mode saves need the training script's code under ``if __name__ == "__main__":``.

DCP's process-mode ``async_save`` starts its checkpoint process with ``spawn``, and a
spawned child imports the parent's main script again, as ``__mp_main__``. Code at the top
level of that script then runs a second time in the child: a script that initialises its
process group there makes the child wait for ranks that never come, and the job hangs with
no output. The mistake shows in the parent before anything is spawned: the manager is
being constructed by top-level code of the main script, outside an
``if __name__ == "__main__":`` block. This module finds that and says so.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import FrameType

from s3ckpt.errors import ConfigError


def require_main_guard(frame: FrameType | None) -> None:
    """Raise :class:`ConfigError` if ``frame``'s call chain starts in unguarded top-level
    code of the main script (``frame``: the caller of the manager's constructor)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            if path and not _guarded(Path(path), frame.f_lineno):
                raise ConfigError(
                    f"async_mode='process' starts DCP's checkpoint process with spawn, which "
                    f"runs {Path(path).name} again from the top: put the training code under "
                    '`if __name__ == "__main__":` (without it the job hangs)'
                )
            return
        frame = frame.f_back


def _guarded(path: Path, line: int) -> bool:
    """Whether ``line`` of ``path`` lies in a top-level ``if __name__ == "__main__":``."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return True  # cannot tell: do not stand in the way
    return any(
        _is_main_test(node.test) and node.lineno <= line <= (node.end_lineno or node.lineno)
        for node in tree.body
        if isinstance(node, ast.If)
    )


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.comparators) == 1):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    values = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return bool(names and values and isinstance(test.ops[0], ast.Eq))
