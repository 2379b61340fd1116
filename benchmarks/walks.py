"""The files one save and one load cross, traced: ``python -m benchmarks.walks``.

A user's script in a fresh process saves with ``CheckpointManager(uri, keep_last=2)``
(process mode, the default) against the embedded S3 server: one save to warm up, then one
traced from ``save`` to the end of ``wait()`` (its commit), then ``load_latest``, traced
to its return. Every process of the run (the trainer and its checkpoint process) records
each call into s3ckpt's own code made during a traced window (:mod:`benchmarks.walk_trace`).

Printed per walk: the s3ckpt modules whose functions ran, per process; the deepest stack
of s3ckpt modules at a send on a socket (the S3 endpoint's, or the checkpoint process's
channel), per process; the files crossed on the way to those sends, per process: the
modules on every path from the process's entry (``save`` in the trainer, its request in
the checkpoint process) to a send, continued through the scheduling hops (tasks, threads,
executor jobs) that a stack alone loses, and the longest such path; and the calls that
climb back: across layers, a call from a
subpackage into one of a layer above it (the layers contract in pyproject.toml); within a
subpackage, a call from module A into module B where B imports A and A does not import B.
Both are callbacks from below into the layer above. The sends whose path goes through the
manager's retention (:data:`RETENTION`, applied by the checkpoint process after the save's
commit, on a thread of its own) are the ``retention`` walk's: its deepest stack, the files
on its paths and its longest path, per process; the save's are the others. With ``--json``
the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Runners of the coroutines handed to them (the event loop thread, the bounded fan-out).
SCHEDULERS = {"s3ckpt/s3/loop.py"}
BACKGROUND = f"s3ckpt{os.sep}background{os.sep}"  # the checkpoint process's entry module
# The manager's retention, which the engine that committed a save applies after it (on a
# thread of its own): the paths through it are reported as their own walk, not the save's.
RETENTION = "s3ckpt/catalog/run_retention.py"
SITECUSTOMIZE = (
    "import os\n"
    "if os.environ.get('S3CKPT_WALK_DIR'):\n"
    "    from benchmarks import walk_trace\n"
    "    walk_trace.install()\n"
)


def case() -> None:
    """The traced user script (run in a fresh process by :func:`main`)."""
    import mmap

    import torch

    from s3ckpt import CheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 16))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    state = {"model": model, "optim": optimizer}
    with open(os.environ["S3CKPT_WALK_WINDOW"], "r+b") as file:
        window = mmap.mmap(file.fileno(), 1)
    uri = os.environ["S3CKPT_WALK_URI"]
    with CheckpointManager(uri, keep_last=2) as manager:
        manager.save(1, state)
        manager.wait()
        window[0] = 1
        manager.save(2, state)
        manager.wait()
        window[0] = 0
    with CheckpointManager(uri, keep_last=2) as manager:
        window[0] = 2
        restored = manager.load_latest(state)
        window[0] = 0
    if restored != 2:
        raise SystemExit(f"load_latest restored step {restored}, not 2")


def layers() -> dict[str, int]:
    """Each subpackage's layer in the import contract (pyproject.toml): 0 is the top."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(
        c for c in project["tool"]["importlinter"]["contracts"] if c["type"] == "layers"
    )
    return {
        name.strip(): depth
        for depth, layer in enumerate(contract["layers"])
        for name in layer.split("|")
    }


def climbing(edges: set[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """The calls that climb back: ``across`` layers (from a subpackage into one of a layer
    above it) and ``within`` a subpackage (from a module into one that imports it, and that
    it does not import). Calls from the runners in ``SCHEDULERS`` (they await what they
    are given) are scheduling, not calls back."""
    import grimp

    graph = grimp.build_graph("s3ckpt")
    modules = set(graph.modules)
    depth = layers()

    def dotted(path: str) -> str | None:
        name = path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        return name if name in modules else None

    def layer(name: str) -> int | None:
        parts = name.split(".")
        return depth.get(parts[1]) if len(parts) > 2 else None

    found: dict[str, list[tuple[str, str]]] = {"across": [], "within": []}
    for caller, callee in sorted(edges):
        a, b = dotted(caller), dotted(callee)
        if a is None or b is None or a == b or caller in SCHEDULERS:
            continue
        low, high = layer(a), layer(b)
        if low is not None and high is not None and a.split(".")[1] != b.split(".")[1]:
            if high < low:
                found["across"].append((caller, callee))
        elif graph.chain_exists(importer=b, imported=a) and not graph.chain_exists(
            importer=a, imported=b
        ):
            found["within"].append((caller, callee))
    return found


def trace() -> dict[str, Any]:
    """Run :func:`case` under the tracer against an embedded server; the walks it took."""
    from s3ckpt.testing.local_s3 import LocalS3Server

    with tempfile.TemporaryDirectory() as tmp, LocalS3Server(data_dir=Path(tmp) / "s3") as s3:
        site = Path(tmp) / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        out = Path(tmp) / "walks"
        out.mkdir()
        window = Path(tmp) / "window"
        window.write_bytes(b"\0")
        paths = [str(site), str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
        env = {
            **os.environ,
            **s3.env(),
            "PYTHONPATH": os.pathsep.join(paths),
            "S3CKPT_WALK_DIR": str(out),
            "S3CKPT_WALK_WINDOW": str(window),
            "S3CKPT_WALK_URI": f"s3://{s3.bucket}/walks",
        }
        subprocess.run([sys.executable, "-m", "benchmarks.walks", "--case"], env=env, check=True)
        records = [json.loads(path.read_text()) for path in sorted(out.glob("*.json"))]
    walks: dict[str, Any] = {}
    retention: dict[str, dict[str, Any]] = {
        "socket_stacks": {},
        "to_sockets": {},
        "longest_path": {},
    }
    for name in ("save", "load"):
        per_process: dict[str, list[str]] = {}
        edges: set[tuple[str, str]] = set()
        found: dict[str, dict[str, Any]] = {
            "socket_stacks": {},
            "to_sockets": {},
            "longest_path": {},
        }
        for record in records:
            side = "checkpoint process" if BACKGROUND in record["argv"][0] else "trainer"
            pairs = record.get(name, [])
            for stack, path in record["sends"].get(name, []):
                # The manager's retention, applied after a save's commit, is a walk of its own.
                walk = retention if name == "save" and RETENTION in path else found
                if len(stack) > len(walk["socket_stacks"].get(side, [])):
                    walk["socket_stacks"][side] = stack
                walk["to_sockets"].setdefault(side, set()).update(path)
                if len(path) > len(walk["longest_path"].get(side, [])):
                    walk["longest_path"][side] = path
            if pairs:
                files = sorted({callee for _caller, callee in pairs})
                per_process[side] = sorted(set(per_process.get(side, [])) | set(files))
                edges |= {(caller, callee) for caller, callee in pairs if caller}
        every = sorted({f for files in per_process.values() for f in files})
        walks[name] = {
            "files": len(every),
            "per_process": per_process,
            "climbing": climbing(edges),
            **sends(found),
        }
    if retention["to_sockets"]:
        walks["retention"] = sends(retention)
    return walks


def sends(walk: dict[str, Any]) -> dict[str, Any]:
    """A walk's sends as reported: its deepest stack at a send, the files on its paths to
    its sends and its longest path, per process."""
    return {
        "socket_stacks": walk["socket_stacks"],
        "to_sockets": {side: sorted(files) for side, files in walk["to_sockets"].items()},
        "longest_path": walk["longest_path"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.case:
        case()
        return 0
    walks = trace()
    if args.json:
        print(json.dumps(walks, indent=2))
        return 0
    for name, walk in walks.items():
        if "files" in walk:
            print(f"{name}: {walk['files']} files")
        else:
            print(f"{name}: the sends of the save's window on paths through {RETENTION}")
        for side, files in walk.get("per_process", {}).items():
            print(f"  {side} ({len(files)}): {' '.join(files)}")
        for side, stack in walk.get("socket_stacks", {}).items():
            print(
                f"  {side}: {len(stack)} files on the stack at a socket send: {' > '.join(stack)}"
            )
        for side, files in walk["to_sockets"].items():
            print(
                f"  {side}: {len(files)} files on the paths to its socket sends: {' '.join(files)}"
            )
        for side, path in walk["longest_path"].items():
            print(f"  {side}: {len(path)} files on its longest path: {' > '.join(path)}")
        for kind, calls in walk.get("climbing", {}).items():
            print(f"  calls climbing back {kind} layers ({len(calls)}):")
            for caller, callee in calls:
                print(f"    {caller} -> {callee}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
