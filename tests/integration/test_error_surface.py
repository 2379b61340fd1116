"""What a user sees when a load or a save fails: one s3ckpt error, its first line the cause.

Each promise is checked in a fresh interpreter running a small script, as a user meets it:
the script catches with ``except Exception``, prints what it caught as JSON, and its
stderr is checked too (no traceback, no DCP warning, no terminal escapes). The checkpoint
process refuses at ``save()`` what it could not rebuild (a class of the script, a local
class, a lambda), naming the state key, uploading nothing; and a prefix too long for S3's
keys is refused at construction.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from s3_servers import ON_BOTH

from s3ckpt import (
    CheckpointManager,
    InvalidURIError,
    MemoryTier,
    S3StorageWriter,
    TieredCheckpointProcess,
    catalog,
)

pytestmark = [pytest.mark.subprocess]

PRELUDE = r"""
import json, sys, warnings
import torch
import s3ckpt
from s3ckpt import CheckpointManager, S3StorageReader

uri, options = sys.argv[1], json.loads(sys.argv[2])
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def caught(exc):
    error = s3ckpt.unwrap(exc)
    return {
        "type": type(exc).__name__,
        "s3ckpt": isinstance(exc, s3ckpt.S3CkptError),
        "unwrapped": type(error).__name__,
        "first_line": str(exc).splitlines()[0] if str(exc) else "",
        "message": str(exc),
        "cause": type(exc.__cause__).__name__ if exc.__cause__ is not None else None,
        "key": getattr(exc, "key", None),
    }


def report(**found):
    print(json.dumps(found), flush=True)
"""


def run_script(
    tmp_path: Path, body: str, uri: str, options: dict[str, Any], *more: str, logged: str = ""
) -> dict[str, Any]:
    """Run ``PRELUDE + body`` as ``train.py`` in a fresh interpreter; its JSON report, after
    checking that it exited cleanly, with no traceback, DCP warning or terminal escape
    anywhere, and nothing on stderr but one line starting with ``logged``, if given."""
    script = tmp_path / "train.py"
    script.write_text(PRELUDE + body)
    done = subprocess.run(
        [sys.executable, str(script), uri, json.dumps(options), *more],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=dict(os.environ),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "metadata is not found" not in done.stderr, done.stderr  # DCP's fallback warning
    assert "\x1b[" not in done.stdout + done.stderr
    lines = done.stderr.splitlines()
    if logged:
        assert len(lines) == 1 and lines[0].startswith(logged), done.stderr
    else:
        assert lines == [], done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


MANAGER_LOAD = r"""
manager = CheckpointManager(uri, **options)
try:
    manager.load(5, {"w": torch.zeros(4)})
except Exception as exc:
    found = caught(exc)
else:
    found = None
manager.close()
report(found=found)
"""


@ON_BOTH
def test_a_manager_load_of_a_missing_step_is_one_error_naming_it(s3_prefix, s3_options, tmp_path):
    found = run_script(tmp_path, MANAGER_LOAD, s3_prefix, s3_options)["found"]
    assert found is not None and found["s3ckpt"]
    assert found["type"] == "CheckpointNotFoundError"
    assert found["first_line"] == (
        f"no committed checkpoint at {s3_prefix}/step-0000000005 (no manifest)"
    )
    assert found["cause"] == "CheckpointException"  # DCP's, chained, not raised


@ON_BOTH
def test_a_manager_load_from_a_missing_bucket_is_one_error_naming_it(s3_options, tmp_path):
    uri = "s3://no-such-bucket-s3ckpt/run"
    found = run_script(tmp_path, MANAGER_LOAD, uri, s3_options)["found"]
    assert found is not None and found["s3ckpt"]
    assert found["type"] == "BucketNotFoundError"
    assert found["first_line"].startswith("no such bucket: s3://no-such-bucket-s3ckpt")


PLAIN_DCP_LOAD = r"""
import torch.distributed.checkpoint as dcp
try:
    dcp.load({"w": torch.zeros(4)}, storage_reader=S3StorageReader(uri, **options))
except BaseException as exc:  # DCP's CheckpointException is a BaseException
    rank, (carried, _) = next(iter(exc.failures.items()))
    report(
        outer=type(exc).__name__, is_exception=isinstance(exc, Exception),
        unwrapped=type(s3ckpt.unwrap(exc)).__name__, carried=str(carried),
        same=s3ckpt.unwrap(exc) is carried,
    )
"""


def test_plain_dcp_load_of_a_missing_checkpoint_carries_the_s3ckpt_error(
    s3_prefix, s3_options, tmp_path
):
    found = run_script(tmp_path, PLAIN_DCP_LOAD, s3_prefix, s3_options)
    assert found["outer"] == "CheckpointException" and not found["is_exception"]
    assert found["unwrapped"] == "CheckpointNotFoundError" and found["same"]
    assert found["carried"] == f"no committed checkpoint at {s3_prefix} (no manifest)"


EVERY_FAILURE = r"""
import fractions
results = {}


def attempt(name, action):
    try:
        action()
    except Exception as exc:
        results[name] = caught(exc)
    else:
        results[name] = None


wrong_key = {**options, "secret_access_key": "not-the-secret-0123456789"}
good = CheckpointManager(uri, async_mode="thread", **options)
good.save(1, {"w": torch.ones(4), "obj": fractions.Fraction(1, 3)})
good.wait()
attempt("missing step", lambda: good.load(9, {"w": torch.zeros(4)}))
attempt("wrong shape", lambda: good.load(1, {"w": torch.zeros(7), "obj": None}))
attempt("untrusted pickle", lambda: good.load(1, {"w": torch.zeros(4), "obj": None}))
attempt(
    "wrong credentials",
    lambda: CheckpointManager(uri, async_mode="thread", **wrong_key).load(1, {}),
)
lost = CheckpointManager("s3://no-such-bucket-s3ckpt/run", async_mode="thread", **options)
lost.save(1, {"w": torch.ones(4)})
attempt("background save", lost.wait)
lost.close()
good.close()
report(**results)
"""


def test_except_exception_catches_every_manager_failure_as_an_s3ckpt_error(
    s3_prefix, s3_options, tmp_path
):
    # the background save's failure is logged when it happens: one line, no traceback
    logged = "background save of step-0000000001 failed: no such bucket: "
    results = run_script(tmp_path, EVERY_FAILURE, s3_prefix, s3_options, logged=logged)
    assert set(results) == {
        "missing step", "wrong shape", "untrusted pickle", "wrong credentials", "background save"
    }  # fmt: skip
    for name, found in results.items():
        assert found is not None, f"{name}: nothing raised"
        assert found["s3ckpt"], f"{name}: {found['type']} is not an s3ckpt error"
        assert found["type"] not in ("CheckpointException", "AssertionError"), name
        assert "\x1b[" not in found["message"], name
        assert found["first_line"].strip(), name
    assert results["missing step"]["type"] == "CheckpointNotFoundError"
    assert results["wrong credentials"]["type"] == "AccessDeniedError"
    assert "not-the-secret" not in results["wrong credentials"]["message"]
    assert results["background save"]["type"] == "BucketNotFoundError"
    assert results["untrusted pickle"]["type"] == "UntrustedPickleError"
    assert "'obj'" in results["untrusted pickle"]["first_line"]
    assert results["wrong shape"]["type"] == "CheckpointError"  # DCP's ValueError, named
    assert results["wrong shape"]["first_line"].startswith(
        f"loading {s3_prefix}/step-0000000001 failed: ValueError: Size mismatch"
    )
    assert results["wrong shape"]["cause"] == "CheckpointException"


PROCESS_MODE_REFUSALS = r"""
import types
from s3ckpt import catalog


class Custom:  # defined in the script: the checkpoint process does not run it
    def __init__(self):
        self.value = 3


def local_object():
    class Local:
        pass

    return Local()


def as_lambda():
    return lambda x: x


manager = CheckpointManager(uri, **options)  # process mode, the default
refused = {}
for name, make in [("main class", Custom), ("local class", local_object), ("lambda", as_lambda)]:
    state = {"w": torch.ones(4), "extra": {"step": 7, "obj": make()}}
    try:
        returned = manager.save(1, state)
    except Exception as exc:
        refused[name] = caught(exc)
    else:
        refused[name] = {"returned": returned}
    manager.wait()
listed = [i.name for i in catalog.list_checkpoints(uri, **options)]
saved = manager.save(1, {"w": torch.arange(4.0), "extra": {"step": 7, "note": "plain"}})
manager.wait()
into = {"w": torch.zeros(4), "extra": {"step": 0, "note": ""}}
manager.load(1, into)
manager.close()
report(
    refused=refused, listed_after_refusals=listed, saved=saved, steps=manager.steps(),
    loaded=into["w"].tolist(), extra=into["extra"],
)
"""


def test_process_mode_refuses_at_save_what_the_checkpoint_process_cannot_rebuild(
    s3_prefix, s3_options, list_keys, tmp_path
):
    found = run_script(tmp_path, PROCESS_MODE_REFUSALS, s3_prefix, s3_options)
    for name in ("main class", "local class", "lambda"):
        refused = found["refused"][name]
        assert "returned" not in refused, f"{name}: save() returned {refused}"
        assert refused["type"] == "UnpicklableStateError", name
        assert refused["key"] == "extra.obj", name
        assert refused["first_line"].startswith("state key 'extra.obj' holds "), name
        assert "define the class or function in a module" in refused["message"], name
    assert "__main__" in found["refused"]["main class"]["message"]
    assert "inside a function" in found["refused"]["local class"]["message"]
    assert "lambda" in found["refused"]["lambda"]["message"]
    assert found["listed_after_refusals"] == []  # nothing committed...
    assert found["saved"] is True and found["steps"] == [1]  # ...and the next save works
    assert found["loaded"] == [0.0, 1.0, 2.0, 3.0]
    assert found["extra"] == {"step": 7, "note": "plain"}
    assert all(key.startswith("step-0000000001/") for key in list_keys(s3_prefix))


TIERED_REFUSAL = r"""
from s3ckpt import MemoryTier, S3StorageWriter, TieredCheckpointProcess


class Custom:
    pass


root = sys.argv[3]
with TieredCheckpointProcess(uri, MemoryTier(root=root, keep=2)) as tiered:
    try:
        tiered.async_save({"w": torch.ones(4), "opt": [{"obj": Custom()}]}, 1)
    except Exception as exc:
        found = caught(exc)
    else:
        found = None
    writer = S3StorageWriter(f"{uri}/step-2", **options)
    save = tiered.async_save({"w": torch.ones(4)}, 2, storage_writer=writer)
    save.result()
    held = tiered.held_steps()
report(found=found, held=held)
"""


def test_the_tiered_process_refuses_a_class_of_the_script_naming_the_key(
    s3_prefix, s3_options, shm_root, tmp_path
):
    found = run_script(tmp_path, TIERED_REFUSAL, s3_prefix, s3_options, str(shm_root))
    assert found["found"] is not None
    assert found["found"]["type"] == "UnpicklableStateError"
    assert found["found"]["key"] == "opt.0.obj"
    assert found["held"] == [2]
    assert [i.name for i in catalog.list_checkpoints(s3_prefix, **s3_options)] == ["step-2"]


LONG = "x" * 1100
# The longest name a save writes under its prefix: the object probing the store for
# conditional writes, at a process's first commit to a bucket (46 bytes).
PROBE = ".s3ckpt-probe-" + "0" * 32


def test_a_prefix_too_long_for_s3_keys_is_refused_at_construction(s3_options, shm_root):
    uri = f"s3://s3ckpt/{LONG}"
    with pytest.raises(InvalidURIError, match=r"1,100 bytes.*1,024 bytes") as info:
        S3StorageWriter(uri, **s3_options)
    assert ".s3ckpt-probe-" in str(info.value)  # the longest name saved under it
    with pytest.raises(InvalidURIError, match="1,024"):
        S3StorageWriter(**s3_options).reset(uri)
    with pytest.raises(InvalidURIError, match=r"1,100 bytes.*step-0000000000/"):
        CheckpointManager(uri, async_mode="thread", **s3_options)
    with pytest.raises(InvalidURIError, match="1,100 bytes"):
        TieredCheckpointProcess(uri, MemoryTier(root=shm_root))
    # the limit is on the whole key: a prefix that leaves room for every name is taken
    fits = "y" * (1024 - len(f"/step-0000000000/{PROBE}"))
    CheckpointManager(f"s3://s3ckpt/{fits}", async_mode="sync", **s3_options).close()
    with pytest.raises(InvalidURIError, match="a prefix of at most 961 bytes fits"):
        CheckpointManager(f"s3://s3ckpt/{fits}z", async_mode="sync", **s3_options)


AT_THE_LIMIT = r"""
import torch.distributed.checkpoint as dcp
from s3ckpt import S3StorageWriter

state = {"w": torch.arange(6.0)}
dcp.save(state, storage_writer=S3StorageWriter(uri, **options), no_dist=True)
into = {"w": torch.zeros(6)}
dcp.load(into, storage_reader=S3StorageReader(uri, **options), no_dist=True)
report(loaded=into["w"].tolist())
"""


def test_a_prefix_at_the_limit_saves_and_loads(s3_options, s3_prefix, list_keys, tmp_path):
    """The refusal's arithmetic matches the store: the longest prefix taken saves, its
    first commit's probe of the store included (a fresh process: probed once per bucket)."""
    name = s3_prefix.split("/", 3)[3]
    uri = f"{s3_prefix}/{'z' * (1024 - len(f'{name}/') - len(f'/{PROBE}'))}"
    found = run_script(tmp_path, AT_THE_LIMIT, uri, s3_options)
    assert found["loaded"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert max(len(f"{name}/{key}".encode()) for key in list_keys(s3_prefix)) <= 1024
