"""Megatron-core ``dist_checkpointing`` through s3ckpt on 2 gloo CPU ranks, against the
embedded SeaweedFS server (megatron-core 0.16.1).

One spawned 2-rank job (``_megatron_worker.all_main``; Megatron's CUDA calls stood in for
there) runs the scenarios one after the other, each rank importing Megatron once; the
tests check the ranks' reports and the store: saves and loads bit-exact (sync, async
through Megatron's ``AsyncCallsQueue``, ``FullyParallelSaveStrategyWrapper``,
``checkpointing_context`` reuse, the quickstart's block as written), plan reuse
(``--ckpt-assume-constant-structure``) over new steps and over a committed one, a failed
background write, Megatron's files in S3 and no ``s3:/`` folder on disk, and wrong uses
refused clearly. A second job is SIGKILLed mid-upload.

Not run here, for want of a GPU: tensors on CUDA devices (their copy to host memory in
``preload_fn`` and the ``torch.cuda.synchronize`` after it), NCCL collectives, and
Megatron's persistent async worker with CUDA tensors (it receives them over CUDA IPC).
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _dist_worker as dist_worker
import _megatron_worker as worker
import pytest
import torch
from s3_servers import held_port

from s3ckpt import catalog
from s3ckpt.config import S3URI
from s3ckpt.format.manifest import MANIFEST_NAME
from s3ckpt.testing.local_s3 import LocalS3Server

# megatron-core is imported by the ranks only, never by the test process.
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None,
        reason="megatron-core is not installed (the megatron extra; make test installs it)",
    ),
]

WORLD = 2
TRACKER = "latest_checkpointed_iteration.txt"
MEGATRON_FILES = ("common.pt", "metadata.json")
MEMBERS = {f"__megatron_file__.{name}/shard_0_1" for name in MEGATRON_FILES}


def reports(out_dir: Path) -> list[dict[str, Any]]:
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def expected(rank: int, step: int) -> dict[str, Any]:
    values = worker.state_values(rank, WORLD, step)
    return {
        "weight": values["weight"],
        "bias": values["bias"],
        "rng": values["rng"],
        "common": values["common"],
    }


def assert_bit_exact(loaded: dict[str, Any], rank: int, step: int) -> None:
    want = expected(rank, step)
    assert torch.equal(loaded["weight"], want["weight"])
    assert torch.equal(loaded["bias"], want["bias"])
    assert torch.equal(loaded["rng"], want["rng"])
    assert loaded["common"] == want["common"]


def keys_under(server: LocalS3Server, uri: str) -> list[str]:
    location = S3URI.parse(uri)
    found: list[str] = []
    for page in (
        server.client()
        .get_paginator("list_objects_v2")
        .paginate(Bucket=location.bucket, Prefix=location.prefix + "/")
    ):
        found += [o["Key"][len(location.prefix) + 1 :] for o in page.get("Contents", [])]
    return sorted(found)


def open_uploads(server: LocalS3Server, uri: str) -> list[str]:
    location = S3URI.parse(uri)
    answer = server.client().list_multipart_uploads(
        Bucket=location.bucket, Prefix=location.prefix + "/"
    )
    return [u["Key"] for u in answer.get("Uploads", [])]


def tracker_text(server: LocalS3Server, run: str) -> str:
    location = S3URI.parse(run)
    body = server.client().get_object(Bucket=location.bucket, Key=location.key(TRACKER))["Body"]
    return body.read().decode()


def no_local_s3_folder(workdir: Path) -> None:
    assert not [p for p in workdir.rglob("s3*") if p.is_dir()], list(workdir.rglob("*"))


SCENARIOS = (
    "failing_write",
    "sync",
    "fully_parallel",
    "context",
    "async",
    "constant",
    "bad_input",
    "quickstart",
)


def quickstart_block(run: str) -> str:
    """The save-and-load ``py`` block of the quickstart's Megatron section, its bucket
    ``ckpt`` moved to ``run``'s place on the test server."""
    block, _ = worker.quickstart_blocks()
    return block.replace("s3://ckpt/", run.rsplit("gpt", 1)[0])


@dataclass
class Job:
    runs: dict[str, str]
    out: Path
    s3: dict[str, Any]

    def reports(self, scenario: str) -> list[dict[str, Any]]:
        return reports(self.out / scenario)


@pytest.fixture(scope="module")
def job(seaweedfs_s3: LocalS3Server, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """Every scenario but the crash, in one 2-rank job (``_megatron_worker.all_main``)."""
    base = f"s3://{seaweedfs_s3.bucket}/test_megatron-{secrets.token_hex(4)}"
    runs = {name: f"{base}/{name}/gpt" for name in SCENARIOS}
    out = tmp_path_factory.mktemp("megatron")
    s3 = dist_worker.server_options(seaweedfs_s3)
    code = quickstart_block(runs["quickstart"])
    dist_worker.run_ranks(worker.all_main, WORLD, s3, runs, str(out), code, timeout=280)
    return Job(runs, out, s3)


@pytest.mark.parametrize("mode", ["sync", "fully_parallel", "context"])
def test_sync_save_and_resume(mode: str, job: Job, seaweedfs_s3: LocalS3Server) -> None:
    """``dist_checkpointing.save`` with the strategy (plain, in Megatron's
    FullyParallelSaveStrategyWrapper, reused from a checkpointing_context for two steps)."""
    run, s3 = job.runs[mode], job.s3
    steps = (1, 2) if mode == "context" else (1,)
    for rank, report in enumerate(job.reports(mode)):
        assert report["tracker"] == steps[-1]
        for step in steps:
            assert_bit_exact(report["loaded"][step], rank, step)
    # Megatron's files are in S3, committed with the tensors; none on the local disk.
    assert tracker_text(seaweedfs_s3, run) == str(steps[-1])
    for step in steps:
        listed = catalog.show_checkpoint(worker.step_dir(run, step), **s3)
        assert {item.fqn for item in listed.items} >= MEMBERS
    assert not [k for k in keys_under(seaweedfs_s3, run) if k.endswith(MEGATRON_FILES)]
    no_local_s3_folder(job.out)


def test_async_save_and_resume(job: Job, seaweedfs_s3: LocalS3Server) -> None:
    """``async_sharded_save=True`` through Megatron's AsyncCallsQueue (a forked writer)."""
    for rank, report in enumerate(job.reports("async")):
        # The tensors changed after the request was scheduled; the save holds step 1.
        assert_bit_exact(report["loaded"][1], rank, 1)
        assert report["tracker"] == 1
    # The tracker was written in the finalization, after the commit (else it is refused).
    assert job.reports("async")[0]["finalized"] == [1]
    assert tracker_text(seaweedfs_s3, job.runs["async"]) == "1"


def test_constant_structure_reuses_plans_safely(job: Job, seaweedfs_s3: LocalS3Server) -> None:
    """``--ckpt-assume-constant-structure``: steps 1, 2, 3, then step 3 again."""
    run, s3 = job.runs["constant"], job.s3
    for rank, report in enumerate(job.reports("constant")):
        # Megatron validates the cache at the second save and replays it from the third.
        assert report["reuse"] == [False, True, True, True]
        assert_bit_exact(report["loaded_3_before"], rank, 3)  # written from a replayed plan
        for step, version in ((1, 1), (2, 2), (3, 4)):
            assert_bit_exact(report["loaded"][step], rank, version)
        assert report["tracker"] == 3
    ids = {catalog.show_checkpoint(worker.step_dir(run, s), **s3).save_id for s in (1, 2, 3)}
    assert len(ids) == 3
    # Saving step 3 again (a replayed plan, over the committed save) left every object
    # of the save it replaced untouched: same keys, same ETags, now unreferenced, and
    # exactly what gc finds.
    replaced = job.reports("constant")[0]["replaced"]
    location = S3URI.parse(worker.step_dir(run, 3))
    client = seaweedfs_s3.client()
    for key, etag in replaced.items():
        assert client.head_object(Bucket=location.bucket, Key=location.key(key))["ETag"] == etag
    current = {o.key for o in catalog.show_checkpoint(worker.step_dir(run, 3), **s3).objects}
    assert not current & set(replaced)
    report = catalog.collect_garbage(run, grace=0, lease=0, **s3)
    assert {(g.name, g.reason) for g in report.garbage} == {("iter_0000003", "unreferenced")}
    collected = {k.rsplit("/iter_0000003/", 1)[1] for g in report.garbage for k in g.keys}
    assert set(replaced) <= collected
    for step in (1, 2, 3):
        assert catalog.verify_checkpoint(worker.step_dir(run, step), **s3).ok


def test_bad_input_gets_one_clear_error(job: Job, seaweedfs_s3: LocalS3Server) -> None:
    errors = job.reports("bad_input")[0]["errors"]
    assert errors["plain_strategy"].startswith("ConfigError: ")
    assert "S3SaveShardedStrategy" in errors["plain_strategy"]
    assert errors["local_path"].startswith("ConfigError: S3SaveShardedStrategy saves to s3://")
    assert errors["tracker_uncommitted"].startswith("CheckpointNotFoundError: refusing to write")
    assert errors["other_file"].startswith("ConfigError: ")
    assert "does not exist" in errors["load_uncommitted"]
    no_local_s3_folder(job.out)
    assert keys_under(seaweedfs_s3, job.runs["bad_input"]) == []  # the refused saves wrote nothing


def test_a_failed_background_write_commits_nothing(job: Job, seaweedfs_s3: LocalS3Server) -> None:
    """Rank 1's background write fails: Megatron's finalization raises on every rank (its
    failure travels as DCP carries one), no manifest, the tracker still names step 1."""
    run = job.runs["failing_write"]
    for report in job.reports("failing_write"):
        assert report["raised"].startswith("CheckpointException"), report["raised"]
        assert report["tracker"] == 1
    assert "on fire" in job.reports("failing_write")[0]["raised"]  # the coordinator's report
    assert not catalog.is_committed(worker.step_dir(run, 2), **job.s3)
    assert tracker_text(seaweedfs_s3, run) == "1"
    # Rank 1 failed before uploading; what rank 0 uploaded for the failed save is gc's.
    catalog.collect_garbage(run, grace=0, lease=0, **job.s3)
    assert keys_under(seaweedfs_s3, worker.step_dir(run, 2)) == []
    assert open_uploads(seaweedfs_s3, worker.step_dir(run, 2)) == []


def test_quickstart_block_runs_as_written(job: Job, seaweedfs_s3: LocalS3Server) -> None:
    """docs/quickstart.md's Megatron block (a ``py`` block: the quickstart's own test does
    not install Megatron), run on the job's ranks: the plan is cached at the first save,
    validated at the second and replayed at the third, and the load gives the third save's
    state."""
    run = job.runs["quickstart"]
    for rank, report in enumerate(job.reports("quickstart")):
        saved, loaded = report["saved"], report["loaded"]
        assert report["reuse"] == [False, True, True]
        # train_step ran between the saves: the third save's state is not the first's.
        assert not torch.equal(saved["weight"], worker.state_values(rank, WORLD, 1)["weight"])
        assert torch.equal(loaded["weight"], saved["weight"])
        assert torch.equal(loaded["bias"], saved["bias"])
        assert loaded["common"] == saved["common"]
    for iteration in (100, 200, 300):
        assert catalog.is_committed(worker.step_dir(run, iteration), **job.s3)


def _wait_for(paths: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"still waiting for {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.1)


def test_sigkill_during_async_save_leaves_nothing_visible(
    seaweedfs_s3: LocalS3Server, s3_prefix: str, tmp_path: Path
) -> None:
    run = f"{s3_prefix}/gpt"
    s3 = dist_worker.server_options(seaweedfs_s3)
    with held_port() as port:
        context = torch.multiprocessing.start_processes(
            worker.crash_main,
            args=(WORLD, port, s3, run, str(tmp_path)),
            nprocs=WORLD,
            join=False,
            start_method="spawn",
        )
        try:
            uploading = [tmp_path / f"uploading-{r}" for r in range(WORLD)]
            _wait_for([*uploading, *(tmp_path / f"scheduled-{r}" for r in range(WORLD))], 120)
            writers = [int(p.read_text()) for p in uploading]
            # The writers hold their second item back, so step 2 cannot commit; kill them
            # once the store shows what the first (the big tensor) started uploading.
            step2 = worker.step_dir(run, 2)
            deadline = time.monotonic() + 120
            while not keys_under(seaweedfs_s3, step2) + open_uploads(seaweedfs_s3, step2):
                assert time.monotonic() < deadline, "step 2 never started uploading"
                time.sleep(0.1)
            for pid in [*writers, *(p.pid for p in context.processes)]:
                os.kill(pid, signal.SIGKILL)
        finally:
            for process in context.processes:
                process.kill()
                process.join(timeout=10)
    # Nothing of step 2 is visible: no manifest, the tracker still names step 1.
    assert MANIFEST_NAME not in keys_under(seaweedfs_s3, step2)
    assert not catalog.is_committed(step2, **s3)
    assert tracker_text(seaweedfs_s3, run) == "1"
    assert catalog.is_committed(worker.step_dir(run, 1), **s3)
    left = keys_under(seaweedfs_s3, step2) + open_uploads(seaweedfs_s3, step2)
    assert left, "the kill came after the save had finished uploading"
    # gc (no grace period) removes every object and aborts every upload the kill left.
    time.sleep(1)  # the killed writers' in-flight records were refreshed up to the kill
    report = catalog.collect_garbage(run, grace=0, lease=0, **s3)
    assert report.objects or report.uploads
    assert keys_under(seaweedfs_s3, step2) == []
    assert open_uploads(seaweedfs_s3, step2) == []
    assert catalog.is_committed(worker.step_dir(run, 1), **s3)


def test_missing_extra_is_a_clear_import_error() -> None:
    code = (
        "import sys; sys.modules['megatron'] = None\n"
        "try:\n"
        "    import s3ckpt.integrations.megatron\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert "pip install './s3ckpt[megatron]'" in out.stdout
