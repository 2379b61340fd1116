"""Faults on the links of a simulated cluster (s3ckpt.testing.cluster): two nodes and a
SeaweedFS storage server in network namespaces, each behind a tbf-shaped link, ranks
talking gloo node to node. A link is cut, flapped, partitioned or throttled while a save
uploads, replicates or commits; every save ends committed whole or failed on every rank
within its deadlines (``deadline_s`` for S3 requests, ``timeout_s`` for collectives),
never a partial checkpoint in S3 and never a rank still waiting; a fresh job then
restores the newest whole step, bit-exact.

Needs root and iproute2 (network namespaces); skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _links_worker import make_state, same

from s3ckpt import CheckpointManager
from s3ckpt.testing.cluster import Cluster
from s3ckpt.testing.netns import NetnsUnavailableError

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.distributed,
]

WORKER = Path(__file__).with_name("_links_worker.py")
NODE_RATE = 10e6  # bytes/s each way: a rank's 8 MiB takes about 0.8 s
STORAGE_RATE = 40e6
DEADLINE_S = 4.0  # S3 requests of a save, all together
READ_TIMEOUT_S = 1.5
TIMEOUT_S = 8.0  # the job's collectives, and the memory tier's (TieredCheckpointProcess)
# the manager's save collectives: the job's timeout, or a save's requests and 10 s more
COLLECTIVE_S = max(TIMEOUT_S, DEADLINE_S + READ_TIMEOUT_S + 10)
SLACK_S = 5.0  # a process's own work around the deadlines on a busy 2-core host
BOUND_S = DEADLINE_S + COLLECTIVE_S + SLACK_S  # the most a faulted save may take to end
BASE = {"deadline_s": DEADLINE_S, "read_timeout": READ_TIMEOUT_S, "timeout_s": TIMEOUT_S, "mib": 8}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    try:
        with Cluster(2, node_rate=NODE_RATE, storage_rate=STORAGE_RATE) as running:
            yield running
    except NetnsUnavailableError as exc:
        pytest.skip(f"no network namespaces here: {exc}")


@pytest.fixture
def links(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster, its links whole and at their rates again after the test."""
    yield cluster
    for link in [*(node.link for node in cluster.nodes), cluster.storage]:
        assert link is not None
        link.stop_flapping()
        link.restore()
        link.shape(NODE_RATE if link is not cluster.storage else STORAGE_RATE)
    cluster.network.heal()


class Job:
    """One run of the worker on every rank (one per node), its marks and reports."""

    def __init__(self, cluster: Cluster, out: Path, **config: Any) -> None:
        self.cluster, self.out = cluster, out
        out.mkdir(parents=True)
        path = out / "config.json"
        path.write_text(json.dumps({"out": str(out), **BASE, **config}))
        self.log = (out / "ranks.log").open("wb")
        self.ranks = cluster.start_ranks(
            [sys.executable, str(WORKER), str(path)], stdout=self.log, stderr=subprocess.STDOUT
        )
        self.started = time.monotonic()

    def wait_for(self, mark: str, rank: int | None = None, timeout: float = 90.0) -> float:
        """When ``mark`` appeared (``<mark>-<rank>``, or ``<mark>`` itself)."""
        path = self.out / (mark if rank is None else f"{mark}-{rank}")
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline or all(r.poll() is not None for r in self.ranks):
                raise AssertionError(f"no {path.name} after {timeout} s:\n{self.log_tail()}")
            time.sleep(0.02)
        return time.monotonic()

    def finish(self, within: float) -> list[dict[str, Any]]:
        """Every rank's report, each rank having ended within ``within`` s from now."""
        codes = self.cluster.wait(self.ranks, within)
        self.log.close()
        assert None not in codes, f"ranks still running after {within} s:\n{self.log_tail()}"
        reports = []
        for rank in range(len(self.ranks)):
            path = self.out / f"report-{rank}.json"
            assert path.exists(), f"rank {rank} left no report:\n{self.log_tail()}"
            reports.append(json.loads(path.read_text()))
        for report in reports:
            assert "crash" not in report, report["crash"]
        return reports

    def log_tail(self) -> str:
        path = self.out / "ranks.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-40:])


def save_job(cluster: Cluster, tmp_path: Path, uri: str, **config: Any) -> Job:
    job = Job(cluster, tmp_path / "save", mode="save", uri=uri, **config)
    job.wait_for("ready", 0)
    job.wait_for("ready", 1)
    return job


def restored(
    cluster: Cluster, tmp_path: Path, uri: str, tier: bool = False, name: str = "restore"
) -> tuple[Any, Any]:
    """The step (and tier) a fresh job restores, every rank the same and bit-exact: the
    two ranks again with the memory tier (their nodes' copies), else this process alone
    (both ranks' state, over the host's link)."""
    if not tier:
        with CheckpointManager(uri, async_mode="sync", **cluster.options()) as manager:
            want = {**make_state(0, 2, BASE["mib"]), **make_state(1, 2, BASE["mib"])}
            state = {key: torch.zeros_like(value) for key, value in want.items()}
            step = manager.load_latest(state)
        assert step is not None
        assert same(state, {**make_state(0, step, BASE["mib"]), **make_state(1, step, BASE["mib"])})
        return step, "s3"
    job = Job(cluster, tmp_path / name, mode="restore", uri=uri, tier=tier)
    reports = job.finish(within=90)
    assert all(r["whole"] for r in reports), reports
    assert len({(r["step"], r["tier"]) for r in reports}) == 1, reports
    return reports[0]["step"], reports[0]["tier"]


def committed(cluster: Cluster, uri: str) -> list[int]:
    with CheckpointManager(uri, async_mode="sync", **cluster.options()) as manager:
        return manager.steps()


@pytest.fixture
def uri(cluster: Cluster, request: pytest.FixtureRequest) -> str:
    import secrets

    return f"s3://{cluster.bucket}/{request.node.name[:60]}-{secrets.token_hex(4)}"


def assert_failed_everywhere(reports: list[dict[str, Any]], key: str = "step2") -> None:
    for report in reports:
        assert not report[key]["ok"], report
        assert report[key]["seconds"] < BOUND_S, report


def assert_saved_everywhere(reports: list[dict[str, Any]], key: str = "step2") -> None:
    for report in reports:
        assert report[key]["ok"], report
        assert report[key]["seconds"] < BOUND_S, report


# -- a node's link -------------------------------------------------------------------------


def test_a_node_cut_for_good_during_its_upload_fails_on_every_rank(links, tmp_path, uri):
    job = save_job(links, tmp_path, uri, tier=False, pause_commit=False)
    job.wait_for("saving", 1)
    time.sleep(0.3)
    links.node(1).cut()
    assert_failed_everywhere(job.finish(within=BOUND_S + 10))
    links.node(1).restore()
    assert committed(links, uri) == [1]
    assert restored(links, tmp_path, uri) == (1, "s3")


def test_a_flapping_link_during_the_upload_commits(links, tmp_path, uri):
    job = save_job(links, tmp_path, uri, tier=False, pause_commit=False)
    job.wait_for("saving", 1)
    links.node(1).link.flap(down_s=0.3, up_s=0.5, times=3)
    assert_saved_everywhere(job.finish(within=BOUND_S + 10))
    assert committed(links, uri) == [1, 2]
    assert restored(links, tmp_path, uri) == (2, "s3")


def test_a_link_throttled_to_one_percent_mid_save_fails_on_every_rank(links, tmp_path, uri):
    """8 MiB at 100 kB/s would take 80 s. The throttled rank's request in flight keeps
    trickling past ``deadline_s`` (the deadline stops retries, not a request that still
    makes progress), and gloo's traffic on that link stalls too: the save fails on every
    rank by the collective timeout, a few seconds later than a cut link's would."""
    job = save_job(links, tmp_path, uri, tier=False, pause_commit=False)
    job.wait_for("saving", 1)
    time.sleep(0.2)
    links.node(1).link.throttle(0.01)
    reports = job.finish(within=BOUND_S + 20)
    for report in reports:
        assert not report["step2"]["ok"], report
        assert report["step2"]["seconds"] < BOUND_S + 10, report
    links.node(1).link.shape(NODE_RATE)
    assert committed(links, uri) == [1]
    assert restored(links, tmp_path, uri) == (1, "s3")


# -- the commit ----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["node1", "storage"])
def test_a_link_cut_for_a_moment_at_the_commit_commits(links, tmp_path, uri, where):
    """Cut just before the coordinator (rank 0, on node 0) writes the manifest, restored
    1.5 s later: the commit's requests are retried, every rank's save ends committed."""
    job = save_job(links, tmp_path, uri, tier=False, pause_commit=True)
    job.wait_for("commit")
    link = links.storage if where == "storage" else links.node(int(where[-1])).link
    link.cut()
    (job.out / "go").touch()
    time.sleep(1.5)
    link.restore()
    assert_saved_everywhere(job.finish(within=BOUND_S + 10))
    assert committed(links, uri) == [1, 2]
    assert restored(links, tmp_path, uri) == (2, "s3")


def test_the_coordinators_link_cut_for_good_at_the_commit_fails_on_every_rank(links, tmp_path, uri):
    """Node 0 (rank 0 writes the manifest) cut off just before it: nothing is committed,
    every rank's save fails within the deadlines; the restore finds step 1."""
    job = save_job(links, tmp_path, uri, tier=False, pause_commit=True)
    job.wait_for("commit")
    link = links.node(0).link
    link.cut()
    (job.out / "go").touch()
    assert_failed_everywhere(job.finish(within=BOUND_S + 10))
    link.restore()
    assert committed(links, uri) == [1]
    assert restored(links, tmp_path, uri) == (1, "s3")


# -- the memory tier's replication -----------------------------------------------------------


def test_a_node_cut_for_a_moment_during_replication_replicates_and_commits(links, tmp_path, uri):
    job = save_job(links, tmp_path, uri, tier=True, pause_commit=False)
    job.wait_for("held", 1)
    links.node(1).cut()
    time.sleep(1.5)
    links.node(1).restore()
    reports = job.finish(within=BOUND_S + 10)
    assert_saved_everywhere(reports, "replicated")
    assert_saved_everywhere(reports)
    assert committed(links, uri) == [1, 2]
    assert restored(links, tmp_path, uri, tier=True) == (2, "memory")


def test_a_partition_between_the_nodes_during_replication_fails_cleanly(links, tmp_path, uri):
    """Both nodes still reach storage, not each other: the save (replication and the
    upload's collectives) fails on both ranks within the collective timeout; nothing of
    step 2 is committed; each node still holds its own copy of step 2, so a restarted
    job restores step 2 whole from memory."""
    job = save_job(links, tmp_path, uri, tier=True, pause_commit=False)
    job.wait_for("held", 1)
    links.network.partition("node0", "node1")
    reports = job.finish(within=BOUND_S + 10)
    assert_failed_everywhere(reports, "replicated")
    assert_failed_everywhere(reports)
    links.network.heal()
    assert committed(links, uri) == [1]
    assert restored(links, tmp_path, uri, tier=True) == (2, "memory")


def test_a_node_cut_during_a_restore_from_its_peer_fails_on_every_rank(links, tmp_path, uri):
    """Node 1 lost its memory; its rank receives its copy from node 0's replica when node
    1's link is cut: the restore fails on both ranks within the collective timeouts (the
    job's group and the tier's ``timeout_s``, which its fetch group waits too, not a new
    group's half hour). With the link back, the next restore loads step 2 whole."""
    job = save_job(links, tmp_path, uri, tier=True, pause_commit=False)
    assert_saved_everywhere(job.finish(within=BOUND_S + 30))
    restore = Job(links, tmp_path / "lost", mode="restore", uri=uri, tier=True, lose_node1=True)
    restore.wait_for("restoring", 1)
    time.sleep(0.2)
    links.node(1).cut()
    assert_failed_everywhere(restore.finish(within=BOUND_S + 10), "restore")
    links.node(1).restore()
    assert restored(links, tmp_path, uri, tier=True, name="again")[0] == 2


# -- the harness itself --------------------------------------------------------------------

KILLED = """
import sys, time
from s3ckpt.testing.cluster import Cluster
cluster = Cluster(1).start()
print(cluster.network.pid, cluster.nodes[0].shm, flush=True)
time.sleep(600)
"""


def test_what_a_killed_cluster_left_is_removed_by_the_next(cluster, tmp_path):
    """A process killed with its cluster up (no atexit) leaves namespaces, a host link,
    folders and a server; the next cluster's start removes them all."""
    from s3ckpt.testing import netns
    from s3ckpt.testing.cluster import sweep_folders

    process = subprocess.Popen([sys.executable, "-c", KILLED], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        pid, shm = process.stdout.readline().split()
        assert any(name.startswith(f"s3ckpt-{pid}-") for name in netns.namespaces())
    finally:
        process.kill()
        process.wait()
    removed = netns.sweep_stale()
    sweep_folders()
    assert f"s3ckpt-{pid}-storage" in removed
    assert (
        f"s3h{pid}"
        not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    )
    assert not any(name.startswith(f"s3ckpt-{pid}-") for name in netns.namespaces())
    assert not Path(shm).exists()
    assert not list(Path(tempfile.gettempdir()).glob(f"s3ckpt-net-{pid}-*"))
    # the module's own cluster, alive, was left alone
    assert cluster.network.switch in netns.namespaces()


def test_without_root_a_cluster_refuses_clearly(monkeypatch):
    import os

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsUnavailableError, match="needs root"):
        Cluster(1).start()
