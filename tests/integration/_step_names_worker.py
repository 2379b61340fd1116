"""The scripts of ``test_step_names.py``, each run in a fresh interpreter as a user runs one.

Endpoint and credentials come from the ``AWS_*`` environment. Every state is one tensor
filled with a number that says which save wrote it.

* ``manager URI LAST KEEP_LAST [ROLLBACK]``: a ``CheckpointManager`` (process mode, the
  default; ``KEEP_LAST`` may be ``none``) that goes on from its latest step (after ``load(ROLLBACK)`` when given: a
  rollback) and saves every step after it up to ``LAST``, waiting for each. Prints
  ``resumed <step or None>``, ``staged <step>`` and ``committed <step>``.
* ``tiered URI ROOT STEP...``: a ``TieredCheckpointProcess`` holding each step in memory
  under ``ROOT`` and writing it to ``URI/step-<STEP>``, as the quickstart's script names
  its checkpoints.
* ``latest URI``: a fresh manager's ``steps()``, what ``load_latest`` returned and the value
  it loaded, as one JSON line.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

from s3ckpt import CheckpointManager, MemoryTier, S3StorageWriter, TieredCheckpointProcess

ELEMENTS = 64 * 1024  # 256 KiB of float32


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((ELEMENTS,), value)}


def say(line: str) -> None:
    print(line, flush=True)


def manager(uri: str, last: int, keep_last: int | None, rollback: int | None) -> None:
    current = state(-1.0)
    on_saved = lambda metrics: say(f"committed {metrics.step}")  # noqa: E731
    with CheckpointManager(uri, keep_last=keep_last, on_saved=on_saved) as checkpoints:
        if rollback is not None:
            checkpoints.load(rollback, current)
            resumed: int | None = rollback
        else:
            resumed = checkpoints.load_latest(current)
        say(f"resumed {resumed}")
        for step in range((resumed or 0) + 1, last + 1):
            current["w"].fill_(step)
            checkpoints.save(step, current)
            say(f"staged {step}")
            checkpoints.wait()


def tiered(uri: str, root: str, steps: list[int]) -> None:
    current = state(-1.0)
    with TieredCheckpointProcess(uri, MemoryTier(keep=2, root=Path(root))) as tier:
        for step in steps:
            current["w"].fill_(step)
            writer = S3StorageWriter(f"{uri}/step-{step}")
            tier.async_save(current, step, storage_writer=writer).result(timeout=120)


def latest(uri: str) -> None:
    current = state(-1.0)
    with CheckpointManager(uri, async_mode="sync") as checkpoints:
        steps = checkpoints.steps()
        loaded = checkpoints.load_latest(current)
        uri_of = checkpoints.uri_of(loaded) if loaded is not None else None
    value = float(current["w"][0])
    say(json.dumps({"steps": steps, "loaded": loaded, "value": value, "uri": uri_of}))


def main(argv: list[str]) -> None:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    command, uri, *rest = argv
    if command == "manager":
        rollback = int(rest[2]) if len(rest) > 2 else None
        keep_last = None if rest[1] == "none" else int(rest[1])
        manager(uri, int(rest[0]), keep_last, rollback)
    elif command == "tiered":
        tiered(uri, rest[0], [int(s) for s in rest[1:]])
    elif command == "latest":
        latest(uri)
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
