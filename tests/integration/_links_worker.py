"""A rank of the link-fault tests (test_links.py), run as a script in a node's network
namespace by :class:`s3ckpt.testing.cluster.Cluster`, which sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``S3CKPT_NODE``, ``S3CKPT_MEMORY_ROOT`` and the ``AWS_*`` endpoint.

``python _links_worker.py CONFIG.json``; the config says:

* ``mode``: ``save`` (step 1 saved whole, then step 2, the step the test faults) or
  ``restore`` (a fresh job loads the newest step and reports whether it is bit-exact);
* ``tier``: save and restore through the memory tier (``TieredCheckpointProcess``,
  replicas on the other node) instead of a thread-mode ``CheckpointManager``;
* ``pause_commit``: the coordinator writes ``commit`` into the out folder just before
  step 2's manifest is written, and waits for ``go`` there (so the test cuts a link at
  the commit; a thread-mode manager commits in the rank's own process);
* ``lose_node1`` (restore, tier): node 1's memory is removed first, so its rank
  restores from node 0's replica of its copy; mark ``restoring`` just before;
* ``deadline_s``, ``read_timeout``, ``timeout_s`` (the gloo groups' collectives), ``mib``
  (each rank's state).

Marks (empty files ``<name>-<rank>`` in ``out``) tell the test where the save is:
``ready`` (step 1 committed on every rank), ``saving`` (step 2 starts), ``held``
(tier: step 2 held in memory). Each rank's report is ``report-<rank>.json``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def make_state(rank: int, step: int, mib: float) -> dict[str, Any]:
    """Rank ``rank``'s state at ``step``: every value derived from both, under keys of
    its own (the same key on two ranks would be one replicated value to DCP)."""
    n = int(mib * (1 << 20) / 4)
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {
        f"w{rank}": torch.randn(n, generator=g),
        f"b{rank}": torch.full((17,), float(step * 10 + rank)),
        f"step{rank}": torch.tensor([step], dtype=torch.int64),
    }


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return all(torch.equal(got[k], want[k]) for k in want)


class Run:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.out = Path(config["out"])
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.uri = config["uri"]
        self.options = {
            "endpoint_url": os.environ["AWS_ENDPOINT_URL"],
            "deadline_s": config["deadline_s"],
            "read_timeout": config["read_timeout"],
            "connect_timeout": config["read_timeout"],
        }
        self.report: dict[str, Any] = {"rank": self.rank}

    def mark(self, name: str) -> None:
        (self.out / f"{name}-{self.rank}").touch()

    def state(self, step: int) -> dict[str, Any]:
        return make_state(self.rank, step, self.config["mib"])

    def writer(self, step: int) -> Any:
        from s3ckpt import S3StorageWriter, step_name

        return S3StorageWriter(f"{self.uri}/{step_name(step)}", **self.options)

    def outcome(self, started: float, wait: Any) -> dict[str, Any]:
        try:
            wait()
            result: dict[str, Any] = {"ok": True}
        except Exception as exc:
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        result["seconds"] = time.monotonic() - started
        return result

    # -- saving ----------------------------------------------------------------------------

    def save(self) -> None:
        if self.config["tier"]:
            self.save_tiered()
        else:
            self.save_managed()

    def save_managed(self) -> None:
        from s3ckpt import CheckpointManager

        with CheckpointManager(self.uri, async_mode="thread", **self.options) as manager:
            manager.save(1, self.state(1))
            manager.wait()
            dist.barrier()
            self.mark("ready")
            if self.config["pause_commit"] and self.rank == 0:
                self.pause_commit()  # step 2's
            started = time.monotonic()
            self.dump_stacks_if_late()
            self.mark("saving")
            state = self.state(2)

            def save() -> None:
                manager.save(2, state)
                manager.wait()

            self.report["step2"] = self.outcome(started, save)
            self.write_report()

    def save_tiered(self) -> None:
        from s3ckpt import MemoryTier, TieredCheckpointProcess

        tier = MemoryTier(keep=2, s3_every=1, node=os.environ["S3CKPT_NODE"])
        tiered = TieredCheckpointProcess(self.uri, tier, timeout_s=self.config["timeout_s"])
        first = tiered.async_save(self.state(1), 1, storage_writer=self.writer(1))
        first.result()
        first.replicated.result()
        dist.barrier()
        self.mark("ready")
        started = time.monotonic()
        self.dump_stacks_if_late()
        self.mark("saving")
        save = tiered.async_save(self.state(2), 2, storage_writer=self.writer(2))
        save.held.result()
        self.mark("held")
        self.report["replicated"] = self.outcome(started, save.replicated.result)
        self.report["step2"] = self.outcome(started, save.result)
        self.write_report()
        tiered.close()

    def dump_stacks_if_late(self) -> None:
        """A rank still busy past the faulted save's deadlines prints where it waits."""
        late = self.config["deadline_s"] + self.config["timeout_s"] + 2
        faulthandler.dump_traceback_later(late, exit=False)

    def pause_commit(self) -> None:
        """The coordinator stops before its manifest until the test says go."""
        from s3ckpt.dcp import save_commit

        commit = save_commit.commit_manifest

        async def paused(*args: Any, **kwargs: Any) -> Any:
            (self.out / "commit").touch()
            deadline = time.monotonic() + 20
            while not (self.out / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            return await commit(*args, **kwargs)

        save_commit.commit_manifest = paused

    # -- restoring -------------------------------------------------------------------------

    def restore(self) -> None:
        from s3ckpt import catalog

        target = {k: torch.zeros_like(v) for k, v in self.state(0).items()}
        if self.config["tier"]:
            from s3ckpt import MemoryTier, TieredCheckpointProcess

            committed = catalog.run_steps(self.uri, **self.options)
            s3_latest = committed.latest()
            tier = MemoryTier(keep=2, s3_every=1, node=os.environ["S3CKPT_NODE"])
            if self.config.get("lose_node1") and self.rank == 1:
                shutil.rmtree(os.environ["S3CKPT_MEMORY_ROOT"])  # node 1 lost its memory
            with TieredCheckpointProcess(
                self.uri, tier, timeout_s=self.config["timeout_s"]
            ) as tiered:
                dist.barrier()
                started = time.monotonic()
                self.mark("restoring")
                self.report["restore"] = self.outcome(
                    started,
                    lambda: self.report.update(got=tiered.restore_latest(target, s3_latest)),
                )
                if not self.report["restore"]["ok"]:
                    self.write_report()
                    return
                restored = self.report.pop("got")
            if restored is not None:
                step, where = restored.step, restored.tier
            elif s3_latest is not None:
                import torch.distributed.checkpoint as dcp

                from s3ckpt import S3StorageReader

                uri = f"{self.uri}/{committed.names[s3_latest]}"
                dcp.load(target, storage_reader=S3StorageReader(uri, **self.options))
                step, where = s3_latest, "s3"
            else:
                step, where = None, None
        else:
            from s3ckpt import CheckpointManager

            with CheckpointManager(self.uri, async_mode="thread", **self.options) as manager:
                step = manager.load_latest(target)
                where = "s3"
        self.report.update(
            step=step, tier=where, whole=step is not None and same(target, self.state(step))
        )
        self.write_report()

    def write_report(self) -> None:
        path = self.out / f"report-{self.rank}.json"
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(self.report))
        partial.replace(path)


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    run = Run(config)
    dist.init_process_group("gloo", timeout=timedelta(seconds=config["timeout_s"]))
    try:
        run.save() if config["mode"] == "save" else run.restore()
    except BaseException:
        run.report["crash"] = traceback.format_exc()[-3000:]
        run.write_report()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a group broken by the fault is not torn down: the rank just ends


if __name__ == "__main__":
    main()
