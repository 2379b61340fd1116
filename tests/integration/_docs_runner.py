"""One run of the documentation's examples: ``python _docs_runner.py PLAN REPORT``.

``PLAN`` (JSON) names a prelude, the names it supplies, and the blocks in order. Every
block runs in this one interpreter (torch is imported once per run), each in a namespace
of its own holding only the names the prelude supplies, made afresh for it: a block that
uses a name it does not define, or an import it does not make, fails here as it would for
a reader who pasted the prelude and the block. ``overrides`` replaces supplied values
(a longer ``total_steps`` for a resumed run).

While the blocks run, what they start is watched, not changed: every future the s3ckpt
and DCP calls of a block create (``dcp.async_save``, ``CheckpointProcess.async_save``,
``TieredCheckpointProcess.async_save`` with its ``held``/``replicated``/``done``,
torch-checkpointing's ``save``) is waited for after the block, and its failure is
reported even when the block never looked at it; ``CheckpointManager.save``'s answers
(``False``: skipped, the step was committed already), ``load_latest`` and
``restore_latest`` are recorded. ``REPORT`` (JSON) gets one entry per block.

The tests call :func:`run_blocks` (one run, a fresh interpreter) and :func:`assert_whole`.
"""

from __future__ import annotations

import builtins
import functools
import json
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

WAIT_S = 180.0


class Watch:
    """What the block running now started: its futures, saves and restores."""

    def __init__(self) -> None:
        self.futures: list[tuple[str, Any]] = []
        self.saves: list[tuple[int, bool]] = []
        self.restored: list[int | None] = []

    def take(self) -> dict[str, Any]:
        failed = [f"{what}: {problem}" for what, f in self.futures if (problem := _failure(f))]
        entry = {
            "futures": len(self.futures),
            "failed": failed,
            "saved": [step for step, saved in self.saves if saved],
            "skipped": [step for step, saved in self.saves if not saved],
            "restored": self.restored,
        }
        self.futures, self.saves, self.restored = [], [], []
        return entry


def _failure(future: Any) -> str | None:
    """Why ``future`` failed (after waiting for it), or None."""
    if hasattr(future, "done") and hasattr(future, "held"):  # a TierSave
        parts = {"held": future.held, "replicated": future.replicated, "done": future.done}
        problems = [f"{name} {p}" for name, f in parts.items() if (p := _failure(f))]
        return "; ".join(problems) or None
    if hasattr(future, "upload_completion"):  # DCP's AsyncSaveResponse
        future = future.upload_completion
    try:
        error = future.exception(timeout=WAIT_S)
    except BaseException as exc:  # a timeout or a cancellation is a failure too
        return repr(exc)
    if error is None:
        return None
    from s3ckpt import unwrap

    error = unwrap(error)  # the s3ckpt error inside DCP's CheckpointException
    return f"{type(error).__name__}: {error}"


def _wrap(owner: Any, name: str, record: Any) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def watched(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        record(args, kwargs, result)
        return result

    setattr(owner, name, watched)


def watch_s3ckpt(watch: Watch) -> None:
    import torch.distributed.checkpoint as dcp

    from s3ckpt.background.process import CheckpointProcess
    from s3ckpt.manager import CheckpointManager
    from s3ckpt.tier.process import TieredCheckpointProcess

    def future(what: str) -> Any:
        return lambda args, kwargs, result: watch.futures.append((what, result))

    _wrap(dcp, "async_save", future("dcp.async_save"))
    _wrap(CheckpointProcess, "async_save", future("CheckpointProcess.async_save"))
    _wrap(TieredCheckpointProcess, "async_save", future("TieredCheckpointProcess.async_save"))
    _wrap(
        CheckpointManager,
        "save",
        lambda args, kwargs, saved: watch.saves.append((kwargs.get("step", args[1]), saved)),
    )
    _wrap(CheckpointManager, "load_latest", lambda a, k, step: watch.restored.append(step))
    _wrap(
        TieredCheckpointProcess,
        "restore_latest",
        lambda a, k, restored: watch.restored.append(None if restored is None else restored.step),
    )


def watch_torch_checkpointing(watch: Watch) -> None:
    from torch_checkpointing import CheckpointManager

    if not hasattr(CheckpointManager.save, "__wrapped__"):
        _wrap(
            CheckpointManager,
            "save",
            lambda args, kwargs, result: (
                watch.futures.append(("torch_checkpointing save", result))
                if isinstance(result, Future)
                else None
            ),
        )


def supplied_names(plan: dict[str, Any]) -> dict[str, Any]:
    """The prelude run afresh; only the names it supplies, ``extra_steps`` added to its
    ``total_steps``."""
    scope: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(plan["prelude"], "<prelude>", "exec"), scope)
    names = {name: scope[name] for name in plan["supplied"]}
    if plan.get("extra_steps"):
        names["total_steps"] += plan["extra_steps"]
    return names


def main(plan_path: str, report_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    watch = Watch()
    watch_s3ckpt(watch)
    report: list[dict[str, Any]] = []
    status = 0
    for name, code in plan["blocks"]:
        if "torch_checkpointing" in code:
            watch_torch_checkpointing(watch)
        scope = {"__name__": "__main__", "__builtins__": builtins}
        if plan.get("prelude"):
            scope |= supplied_names(plan)
        print(f"--- {name}", flush=True)
        began = time.monotonic()
        try:
            exec(compile(code, name, "exec"), scope)
            error = None
        except BaseException:  # reported with the block; the run stops
            error = traceback.format_exc()
        watched = watch.take()  # waits for the block's futures
        seconds = round(time.monotonic() - began, 2)
        report.append({"block": name, "error": error, "seconds": seconds, **watched})
        if error is not None:
            print(error, file=sys.stderr, flush=True)
            status = 1
            break
    Path(report_path).write_text(json.dumps(report, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))


# -- the tests' side ------------------------------------------------------------------------


def run_blocks(
    blocks: Sequence[tuple[str, str]],
    *,
    env: Mapping[str, str],
    cwd: Path,
    prelude: str | None = None,
    supplied: Sequence[str] = (),
    extra_steps: int = 0,
    timeout: float = 280,
) -> list[dict[str, Any]]:
    """One run of ``blocks`` (name, code) in a fresh interpreter; its report, one entry
    per block. Fails with the block's traceback and the run's output if a block raised."""
    plan = {
        "blocks": list(blocks),
        "prelude": prelude,
        "supplied": list(supplied),
        "extra_steps": extra_steps,
    }
    with tempfile.TemporaryDirectory(prefix="s3ckpt-docs-") as folder:
        plan_path, report_path = Path(folder) / "plan.json", Path(folder) / "report.json"
        plan_path.write_text(json.dumps(plan))
        done = subprocess.run(
            [sys.executable, __file__, str(plan_path), str(report_path)],
            env=dict(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        report = json.loads(report_path.read_text()) if report_path.exists() else []
    failed = [entry for entry in report if entry["error"]]
    assert done.returncode == 0, (
        f"{failed[0]['block'] if failed else 'the run'} failed:\n"
        f"{failed[0]['error'] if failed else ''}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
    assert [entry["block"] for entry in report] == [name for name, _ in blocks]
    return report


def assert_whole(report: list[dict[str, Any]], *, resumed: bool) -> None:
    """Every future a block created succeeded, no step was saved twice (a run that starts
    over instead of resuming saves a committed step again: the manager skips it), and in
    a resumed run every restore found a step."""
    for entry in report:
        assert not entry["failed"], f"{entry['block']}: a save failed: {entry['failed']}"
        assert not entry["skipped"], f"{entry['block']}: saved again: steps {entry['skipped']}"
        if resumed:
            assert None not in entry["restored"], f"{entry['block']} did not resume"
        else:
            assert set(entry["restored"]) <= {None}, f"{entry['block']}: a first run restored"
