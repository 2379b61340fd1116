"""``make bench`` (and ``python -m benchmarks.links``): saves and restores against the
limit of the links, on a simulated cluster (:mod:`s3ckpt.testing.cluster`).

Nodes and a SeaweedFS server in network namespaces, each node behind a link of
``--node-mbps`` and the server behind one of ``--storage-mbps`` (tbf, both directions;
megabytes per second), one gloo rank per node with ``--mib`` of state. Measured:

* **scale**: for 1, 2, 4 and 8 nodes, the job-wide time of a save (from a barrier until
  every rank's save is committed: a thread-mode ``CheckpointManager``, after one warm-up
  save) and of a restore (``load_latest``), against the time the bytes take over the
  binding link: ``nodes x mib`` at ``min(storage, nodes x node)``. Target: within 1.2x.
* **sharing** (two nodes, the memory tier, ``TieredCheckpointProcess``): the S3 upload
  alone (``replicas=0``), replication alone (held only), and both at once over the same
  node links: how much each slows the other, and whether the S3 step still commits.
* **peer restore**: node 1's memory lost, its rank restores from node 0's replica; its
  throughput against the link's, measured by a gloo send of the same bytes from node 0
  to node 1. Target: 0.7x the link or better.

Ratios are reported, not pass/fail: a table and ``benchmarks/results/links.json``. The
server is SeaweedFS (the zero-cost server listens on loopback only), so on a host with few
cores its CPU can show beside the links'. Needs root (network namespaces).

    python -m benchmarks.links [--nodes 1,2,4,8] [--mib 16] [--node-mbps 12.5]
                               [--storage-mbps 50]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "links.json"
ROOT = Path(__file__).resolve().parents[1]
MB = 1e6


# -- rank side (in a node's namespace) -------------------------------------------------------


def _state(rank: int, mib: float) -> dict[str, Any]:
    import torch

    return {f"w{rank}": torch.randn(int(mib * (1 << 20) / 4))}


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - started


def _scale_rank(config: dict[str, Any], rank: int) -> dict[str, Any]:
    from s3ckpt import CheckpointManager

    state = _state(rank, config["mib"])
    with CheckpointManager(config["uri"], async_mode="thread") as manager:
        manager.save(1, state)  # warm-up: the save group, plans, connections
        manager.wait()

        def save() -> None:
            manager.save(2, state)
            manager.wait()

        saved = _timed(save)
        target = {k: v.clone().zero_() for k, v in state.items()}
        restored = _timed(lambda: manager.load_latest(target))
    return {"save_s": saved, "restore_s": restored}


def _tier_rank(config: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from s3ckpt import MemoryTier, S3StorageWriter, TieredCheckpointProcess, catalog, step_name

    state, node = _state(rank, config["mib"]), os.environ["S3CKPT_NODE"]
    uri = config["uri"]
    out: dict[str, Any] = {}
    # the link, as replication rides it: the same bytes sent by gloo from node 0 to node 1
    payload = next(iter(state.values()))
    out["link_s"] = _timed(
        lambda: dist.send(payload, 1) if rank == 0 else dist.recv(torch.empty_like(payload), 0)
    )

    def save(tiered: Any, step: int, upload: bool) -> dict[str, float]:
        writer = S3StorageWriter(f"{uri}/{step_name(step)}") if upload else None
        dist.barrier()
        started = time.perf_counter()
        done = tiered.async_save(state, step, storage_writer=writer)
        done.held.result()
        held = time.perf_counter() - started
        done.replicated.result()
        replicated = time.perf_counter() - started
        done.result()
        finished = time.perf_counter() - started
        dist.barrier()
        return {"held_s": held, "replicated_s": replicated, "done_s": finished}

    with TieredCheckpointProcess(uri, MemoryTier(replicas=0, node=node)) as alone:
        save(alone, 1, upload=False)  # warm-up
        out["upload"] = save(alone, 2, upload=True)
    with TieredCheckpointProcess(uri, MemoryTier(replicas=1, node=node)) as tiered:
        save(tiered, 3, upload=False)  # warm-up
        out["replicate"] = save(tiered, 4, upload=False)
        out["both"] = save(tiered, 5, upload=True)
    out["committed"] = catalog.run_steps(uri).current()
    if rank == 1:
        shutil.rmtree(os.environ["S3CKPT_MEMORY_ROOT"])  # node 1 lost
    dist.barrier()
    target = {k: v.clone().zero_() for k, v in state.items()}
    with TieredCheckpointProcess(uri, MemoryTier(replicas=1, node=node)) as tiered:
        restored = tiered.restore_latest(target)
    # choosing the step (with node 1's copy fetched from node 0) and loading it
    out["peer_restore_s"] = restored.select_s + restored.load_s if restored else None
    out["peer_step"] = (restored.step, restored.tier) if restored else None
    out["peer_whole"] = all(torch.equal(target[k], state[k]) for k in state)
    return out


def rank_main(path: str) -> None:
    import torch
    import torch.distributed as dist

    config = json.loads(Path(path).read_text())
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    result = (_scale_rank if config["case"] == "scale" else _tier_rank)(config, rank)
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


# -- driver ----------------------------------------------------------------------------------


def _run(cluster: Any, case: str, mib: float, out: Path) -> list[dict[str, Any]]:
    out.mkdir(parents=True)
    uri = f"s3://{cluster.bucket}/links-{case}-{secrets.token_hex(4)}"
    config = out / "config.json"
    config.write_text(json.dumps({"case": case, "mib": mib, "uri": uri, "out": str(out)}))
    with (out / "ranks.log").open("wb") as log:
        ranks = cluster.start_ranks(
            [sys.executable, "-m", "benchmarks.links", "--rank", str(config)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        codes = cluster.wait(ranks, timeout=900)
    reports = [out / f"rank{r}.json" for r in range(len(ranks))]
    if codes != [0] * len(ranks) or not all(p.exists() for p in reports):
        tail = (out / "ranks.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{case} ranks ended {codes}:\n{tail}")
    return [json.loads(p.read_text()) for p in reports]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from s3ckpt.testing.cluster import Cluster

    node_rate, storage_rate = args.node_mbps * MB, args.storage_mbps * MB
    nbytes = int(args.mib * (1 << 20))
    report: dict[str, Any] = {
        "mib_per_node": args.mib, "node_MBps": args.node_mbps,
        "storage_MBps": args.storage_mbps, "scale": [],
    }  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="s3ckpt-bench-links-"))
    try:
        for nodes in args.nodes:
            binding = min(storage_rate, nodes * node_rate)
            link_s = nodes * nbytes / binding
            with Cluster(nodes, node_rate=node_rate, storage_rate=storage_rate) as cluster:
                ranks = _run(cluster, "scale", args.mib, work / f"scale-{nodes}")
            save_s = max(r["save_s"] for r in ranks)
            restore_s = max(r["restore_s"] for r in ranks)
            report["scale"].append({
                "nodes": nodes, "binding_MBps": binding / MB, "link_s": link_s,
                "save_s": save_s, "restore_s": restore_s,
                "save_x": save_s / link_s, "restore_x": restore_s / link_s,
            })  # fmt: skip
            print(f"{nodes} node(s): {report['scale'][-1]}", flush=True)
        with Cluster(2, node_rate=node_rate, storage_rate=storage_rate) as cluster:
            ranks = _run(cluster, "tier", args.mib, work / "tier")
        report["tier"] = ranks
        link_s = max(r["link_s"] for r in ranks)
        report["link_measured_MBps"] = nbytes / link_s / MB
        peer = ranks[1]["peer_restore_s"]
        report["peer_restore_x_link"] = link_s / peer if peer else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def table(report: dict[str, Any]) -> str:
    lines = [
        f"Per node {report['mib_per_node']} MiB; node links {report['node_MBps']} MB/s, "
        f"storage link {report['storage_MBps']} MB/s (tbf, both directions)",
        "",
        "| nodes | binding link MB/s | link time s | save s | save / link | restore s | restore / link |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["scale"]:
        lines.append(
            f"| {row['nodes']} | {row['binding_MBps']:.1f} | {row['link_s']:.2f} | "
            f"{row['save_s']:.2f} | {row['save_x']:.2f}x | {row['restore_s']:.2f} | "
            f"{row['restore_x']:.2f}x |"
        )
    tier = report.get("tier")
    if tier:
        worst = {
            case: {k: max(r[case][k] for r in tier) for k in tier[0][case]}
            for case in ("upload", "replicate", "both")
        }
        lines += [
            "",
            "| two nodes, memory tier | held s | replicated s | in S3 s |",
            "|---|---:|---:|---:|",
        ]
        for case, label in (("upload", "upload alone"), ("replicate", "replication alone"),
                             ("both", "replication + upload")):  # fmt: skip
            w = worst[case]
            lines.append(
                f"| {label} | {w['held_s']:.2f} | {w['replicated_s']:.2f} | {w['done_s']:.2f} |"
            )
        committed = tier[0]["committed"]
        lines += [
            "",
            f"Replication slowed by the upload: {worst['both']['replicated_s'] / worst['replicate']['replicated_s']:.2f}x; "
            f"the upload slowed by replication: {worst['both']['done_s'] / worst['upload']['done_s']:.2f}x; "
            f"steps committed: {committed}",
            f"Link measured (gloo, node 0 to node 1): {report['link_measured_MBps']:.1f} MB/s; "
            f"restore from the peer's replica: {report['peer_restore_x_link']:.2f}x the link "
            f"(target 0.7x; step {tier[1]['peer_step']}, bit-exact: {tier[1]['peer_whole']})",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    parser.add_argument("--nodes", default="1,2,4,8")
    parser.add_argument("--mib", type=float, default=16)
    parser.add_argument("--node-mbps", type=float, default=12.5)
    parser.add_argument("--storage-mbps", type=float, default=50)
    args = parser.parse_args()
    if args.rank:
        rank_main(args.rank)
        return
    args.nodes = [int(n) for n in args.nodes.split(",")]
    from s3ckpt.testing.netns import NetnsUnavailableError

    try:
        report = measure(args)
    except NetnsUnavailableError as exc:
        print(f"links: not run: {exc}")
        return
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(table(report))


if __name__ == "__main__":
    main()
