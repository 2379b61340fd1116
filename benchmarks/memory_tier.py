"""``make bench`` (and ``python -m benchmarks.memory_tier``): the memory tier, measured.

Two gloo ranks, each on a simulated node of its own (a folder of /dev/shm as the node's
shared memory, ``MemoryTier(node=...)``), each with ``--size-mib`` of state in
``--tensors`` tensors; S3 is the zero-cost server (:mod:`benchmarks.zero_server`), so the
S3 figures are what the client spends. Per rank, in one run:

* a bare copy of the same bytes (first into fresh memory, then into memory already
  touched): the anchor for blocking and for restores from the own copy;
* the link: the state's bytes sent from one rank to the other over gloo (what
  replication and a peer restore ride on);
* saves to memory only (``replicas=1``): blocking time (the first save, then steady),
  time until held locally and until replicated to the peer node; one save also to S3;
* restores with ``load_latest``: from the own copy (every rank restarted), from the peer
  after rank 1's node is lost (its memory removed), and from S3 (``load`` of the S3
  step); the step-selection time of each;
* a job restarted with one rank instead of two (world size changed): the node that kept
  rank 0's copy and rank 1's replica restores both ranks' state into one process from
  them (resharded, :mod:`s3ckpt.tier.restore`), against the same step loaded from S3;
* shared memory used per node against the state size;
* the training loop beside replication: each rank steps a dispatch-bound loop
  (:func:`benchmarks.loop_cases.dispatch_loop`) alone, then while a save is held and
  replicated by the checkpoint processes; its slowdown during that time;
* steps lost per failure at a stated interval (``--step-s``, ``--every``, ``--s3-every``):
  from the figures above, a failure at a random moment loses the steps since the newest
  step it can restore (the newest *replicated* one for a lost node) plus the restore, in
  steps; against S3 alone at its own interval (its upload time and restore).

Beside it, in the same run, the peers with the same state and ranks
(:mod:`benchmarks.tier_peers`): NVRx's ``LocalCheckpointManager`` with clique replication
(environment ``.venv-tierpeers``, made by ``make bench``) and ML Flashpoint (environment
``.venv-flashpoint``, built by hand: see :mod:`benchmarks.tier_peers.flashpoint`); a peer
whose environment is missing is reported as not run.

Targets (docs/performance.md): blocking within 1.2x a bare copy; restore from the own copy
within 1.5x a bare copy; from a peer at least 0.7x the link's throughput. Reported as
ratios, not pass/fail. Output: a table and ``benchmarks/results/memory_tier.json``.

    python -m benchmarks.memory_tier [--size-mib 256] [--tensors 16] [--saves 5]
                                     [--step-s 1] [--every 10] [--s3-every 100]
                                     [--peers nvrx,flashpoint]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
# the measures every system reports, and where each rank's report has them
TIER_ROWS: dict[str, tuple[str, ...]] = {
    "save blocking, first": ("blocked_first_s",),
    "save blocking, steady": ("blocked_steady_s",),
    "held locally after": ("held_s",),
    "replicated after": ("replicated_s",),
    "restore, own copy": ("own", "total_s"),
    "restore, from the peer (node lost)": ("peer", "total_s"),
    "step selection, own copy": ("own", "select_s"),
    "step selection, from the peer": ("peer", "select_s"),
}
# each peer's module in benchmarks.tier_peers and the environment it runs in
PEERS = {"nvrx": ".venv-tierpeers", "flashpoint": ".venv-flashpoint"}
BLOCKING_MAX, OWN_RESTORE_MAX, PEER_OVER_LINK_MIN = 1.2, 1.5, 0.7


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--step-s", type=float, default=1.0, help="a training step's time")
    parser.add_argument("--every", type=int, default=10, help="steps between memory saves")
    parser.add_argument("--s3-every", type=int, default=100, help="steps between S3 saves")
    parser.add_argument("--peers", default=",".join(PEERS), help="peers to run beside it")
    args = parser.parse_args(argv)
    if args.saves < 3:
        parser.error("--saves must be at least 3 (two slots to fill, then steady saves)")
    report = measure(args.size_mib, args.tensors, args.saves)
    report["peers"] = {
        name: measure_peer(name, args.size_mib, args.tensors, args.saves)
        for name in filter(None, args.peers.split(","))
    }
    report["steps_lost"] = steps_lost(report, args.step_s, args.every, args.s3_every)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory_tier.json").write_text(json.dumps(report, indent=2))
    print(table(report))
    return 0


def measure(size_mib: int, tensors: int, saves: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.multiprocessing as tmp

    from benchmarks.zero_server import ZeroS3

    shm = Path(tempfile.mkdtemp(prefix="s3ckpt-bench-tier-", dir="/dev/shm"))
    try:
        with ZeroS3(pool_mib=min(4 * size_mib + 256, 6144)) as server:
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            uri = f"s3://{server.bucket}/tier-{int(time.time())}"
            out = shm / "reports"
            out.mkdir()
            args = (2, store.port, server.env(), uri, str(shm), str(out), size_mib, tensors, saves)
            tmp.start_processes(_rank, args=args, nprocs=2, join=True, start_method="spawn")
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
            resharded = _resharded(uri, server.env(), shm / "node0", size_mib, tensors, saves)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return {**summarize(ranks, size_mib=size_mib, tensors=tensors), "resharded": resharded}


def _rank(
    rank: int, world: int, port: int, env: dict[str, str], uri: str, shm: str, out: str,
    size_mib: int, tensors: int, saves: int,
) -> None:  # fmt: skip
    import torch
    import torch.distributed as dist

    from s3ckpt import CheckpointManager, MemoryTier

    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    s3: dict[str, Any] = {}  # endpoint and credentials from the AWS_* variables
    state = _state(rank, size_mib, tensors)  # its own shards
    nbytes = sum(t.nbytes for t in state.values())
    result: dict[str, Any] = {"rank": rank, "bytes": nbytes}
    result["copy_first_s"], result["copy_steady_s"] = _bare_copies(state)
    result["link_s"] = _link(nbytes, rank)
    tier = MemoryTier(keep=2, s3_every=1 << 30, root=Path(shm) / f"node{rank}", node=f"node{rank}")
    with CheckpointManager(uri, memory_tier=tier, **s3) as manager:
        metrics = []
        for step in range(1, saves + 1):
            dist.barrier()
            manager.save(step, state)
            metrics.append(manager.wait())
        result["loop"] = _loop_beside(manager, state, saves + 1)
        s3_step = _s3_step(saves)
        dist.barrier()
        manager.save(s3_step, state, s3=True)
        metrics.append(manager.wait())
        result["upload_s"] = metrics[-1].upload_s
    result["blocked_first_s"] = metrics[0].blocked_s
    # steady: from the third save on (the first two each fill a slot's memory first)
    result["blocked_steady_s"] = statistics.median(m.blocked_s for m in metrics[2:saves])
    result["held_s"] = statistics.median(m.held_s for m in metrics[:saves])
    result["replicated_s"] = statistics.median(m.replicated_s for m in metrics[:saves])
    result["shm_bytes"] = _node_bytes(tier.root)
    result["own"] = _restore(uri, tier, s3, state)
    dist.barrier()
    if rank == 1:
        shutil.rmtree(tier.root)  # node 1 lost
    result["peer"] = _restore(uri, tier, s3, state)
    result["s3"] = _restore(uri, tier, s3, state, step=s3_step)
    assert s3_step == _s3_step(saves)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _loop_beside(manager: Any, state: dict[str, Any], step: int) -> dict[str, float]:
    """The dispatch loop's step time alone, then while ``step``'s copy is held and
    replicated in the background (the save's blocking copy not counted)."""
    import torch.distributed as dist

    from benchmarks.loop_cases import dispatch_loop

    loop = dispatch_loop()
    dist.barrier()
    alone = _steps_for(loop, 1.0)
    dist.barrier()
    manager.save(step, state)
    started, steps = time.perf_counter(), 0
    while manager.busy:
        loop()
        steps += 1
    during = (time.perf_counter() - started) / max(steps, 1)
    manager.wait()
    return {
        "step_alone_s": alone,
        "step_during_s": during,
        "background_s": time.perf_counter() - started,
    }


def _steps_for(loop: Any, seconds: float) -> float:
    """The loop's mean step time over about ``seconds``."""
    started, steps = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        loop()
        steps += 1
    return (time.perf_counter() - started) / steps


def _bare_copies(state: dict[str, Any]) -> tuple[float, float]:
    """A copy of the state into fresh memory, then into that memory again; both ranks at
    once, as their saves and restores run."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    copies = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():
        copies[k].copy_(v)
    first = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    for k, v in state.items():
        copies[k].copy_(v)
    return first, time.perf_counter() - start


def _link(nbytes: int, rank: int) -> float:
    """Seconds to send ``nbytes`` from rank 0 to rank 1 over gloo (in 256 MiB pieces)."""
    import torch
    import torch.distributed as dist

    buffer = torch.empty(nbytes, dtype=torch.uint8)
    dist.barrier()
    start = time.perf_counter()
    for piece in buffer.split(256 << 20):
        (dist.send if rank == 0 else dist.recv)(piece, 1 - rank)
    dist.barrier()
    return time.perf_counter() - start


def _state(rank: int, size_mib: int, tensors: int) -> dict[str, Any]:
    import torch

    numel = size_mib * (1 << 20) // 4 // tensors
    random = torch.Generator().manual_seed(rank)
    return {f"rank{rank}.layer{i}": torch.randn(numel, generator=random) for i in range(tensors)}


def _s3_step(saves: int) -> int:
    """The last step the ranks save, to memory and S3."""
    return saves + 2


def _resharded(
    uri: str, env: dict[str, str], root: Path, size_mib: int, tensors: int, saves: int
) -> dict[str, Any]:
    """One process restores what both ranks saved, from node 0's copies (its own and rank
    1's replica), then the same step from S3: each one's time, source, exactness."""
    from s3ckpt import CheckpointManager, MemoryTier

    expected = {**_state(0, size_mib, tensors), **_state(1, size_mib, tensors)}
    tier = MemoryTier(keep=2, s3_every=1 << 30, root=root, node="node0")
    before = dict(os.environ)
    os.environ.update(env)
    try:
        found = {}
        for source in ("memory", "s3"):
            state = {k: v.clone().zero_() for k, v in expected.items()}
            with CheckpointManager(uri, memory_tier=tier) as manager:
                start = time.perf_counter()
                if source == "memory":
                    manager.load_latest(state)
                    where = manager.last_restore.tier
                else:
                    manager.load(_s3_step(saves), state)
                    where = "s3"
                total = time.perf_counter() - start
            exact = all(v.equal(expected[k]) for k, v in state.items())
            found[source] = {"tier": where, "total_s": total, "exact": exact}
        return found
    finally:
        os.environ.clear()
        os.environ.update(before)


def _restore(
    uri: str, tier: Any, s3: dict[str, Any], like: dict[str, Any], step: int | None = None
):
    import torch
    import torch.distributed as dist

    from s3ckpt import CheckpointManager

    state = {k: torch.zeros_like(v) for k, v in like.items()}
    with CheckpointManager(uri, memory_tier=tier, **s3) as manager:
        dist.barrier()
        start = time.perf_counter()
        if step is None:
            manager.load_latest(state)
            restored = manager.last_restore
            total = time.perf_counter() - start
            where, select = restored.tier, restored.select_s
        else:
            manager.load(step, state)
            total, where, select = time.perf_counter() - start, "s3", 0.0
    exact = all(torch.equal(state[k], like[k]) for k in like)
    return {"tier": where, "total_s": total, "select_s": select, "exact": exact}


def _node_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def measure_peer(name: str, size_mib: int, tensors: int, saves: int) -> dict[str, Any]:
    """Run peer ``name``'s two ranks in its own environment; the slowest rank's figures,
    or why it did not run."""
    python = ROOT / PEERS[name] / "bin" / "python"
    if not python.exists():
        return {"ran": False, "why": f"{PEERS[name]} is not installed"}
    with tempfile.TemporaryDirectory(prefix=f"s3ckpt-bench-{name}-") as out:
        command = [str(python), "-m", f"benchmarks.tier_peers.{name}", "--size-mib",
                   str(size_mib), "--tensors", str(tensors), "--saves", str(saves), "--out", out]  # fmt: skip
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
        files = [Path(out, f"{name}-rank{rank}.json") for rank in range(2)]
        if done.returncode != 0 or not all(f.exists() for f in files):
            return {"ran": False, "why": (done.stderr or done.stdout)[-800:]}
        ranks = [json.loads(f.read_text()) for f in files]

    def slowest(key: str, sub: str | None = None) -> float | None:
        values = [r[key][sub] if sub else r[key] for r in ranks]
        return None if None in values else max(values)

    return {
        "ran": True,
        "seconds": {name: slowest(*keys) for name, keys in TIER_ROWS.items()},
        "exact": {k: all(r[k].get("exact") for r in ranks) for k in ("own", "peer")},
        "shm_bytes_per_node": [r["shm_bytes"] for r in ranks],
        "notes": sorted({note for r in ranks for note in r.get("notes", [])}),
    }


def summarize(ranks: list[dict[str, Any]], *, size_mib: int, tensors: int) -> dict[str, Any]:
    """The slowest rank's figure for each measure (a save or restore waits for it)."""

    def slowest(key: str, sub: str | None = None) -> float:
        return max(r[key][sub] if sub else r[key] for r in ranks)

    nbytes = ranks[0]["bytes"]
    copy = slowest("copy_steady_s")
    link_gbs = nbytes / slowest("link_s") / 1e9
    peer_gbs = nbytes / slowest("peer", "total_s") / 1e9
    rows = {
        "bare copy (fresh memory)": slowest("copy_first_s"),
        "bare copy (touched memory)": copy,
        "link: state over gloo": slowest("link_s"),
        **{name: slowest(*keys) for name, keys in TIER_ROWS.items()},
        "restore, from S3": slowest("s3", "total_s"),
        "upload to S3 (a save also to S3)": slowest("upload_s"),
    }
    slowdown = max(r["loop"]["step_during_s"] / r["loop"]["step_alone_s"] - 1 for r in ranks)
    return {
        "benchmark": "memory_tier",
        "size_mib": size_mib,
        "tensors": tensors,
        "ranks": 2,
        "seconds": rows,
        "sources": {k: [r[k]["tier"] for r in ranks] for k in ("own", "peer", "s3")},
        "exact": {k: all(r[k]["exact"] for r in ranks) for k in ("own", "peer", "s3")},
        "shm_bytes_per_node": [r["shm_bytes"] for r in ranks],
        "state_bytes_per_rank": nbytes,
        "loop_beside_replication": {
            "slowdown": slowdown,
            "ranks": [r["loop"] for r in ranks],
        },
        "targets": [
            _target(
                "save blocking / bare copy", rows["save blocking, steady"] / copy, BLOCKING_MAX
            ),
            _target("own restore / bare copy", rows["restore, own copy"] / copy, OWN_RESTORE_MAX),
            {
                "target": "peer restore / link throughput",
                "ratio": peer_gbs / link_gbs,
                "goal": f">= {PEER_OVER_LINK_MIN}",
            },
        ],
    }


def steps_lost(report: dict[str, Any], step_s: float, every: int, s3_every: int) -> dict[str, Any]:
    """Mean steps a failure at a random moment costs, from the measured figures: a save
    every ``every`` steps of ``step_s`` becomes restorable ``ready`` seconds after it
    (held locally for a restarted process, replicated for a lost node, uploaded for S3),
    so the newest restorable step is on average ``interval / 2 + ready`` old; the restore
    adds its own time. The job's relaunch (the same whatever restores it) is not counted."""
    seconds = report["seconds"]

    def lost(interval_steps: int, ready_s: float, restore_s: float) -> float:
        return (interval_steps * step_s / 2 + ready_s + restore_s) / step_s

    def memory(seconds: dict[str, float]) -> tuple[float, float]:
        return (
            lost(every, seconds["held locally after"], seconds["restore, own copy"]),
            lost(every, seconds["replicated after"], seconds["restore, from the peer (node lost)"]),
        )

    found = {
        "step_s": step_s,
        "every": every,
        "s3_every": s3_every,
        "s3ckpt": memory(seconds),
        f"S3 alone, every {s3_every} steps": lost(
            s3_every, seconds["upload to S3 (a save also to S3)"], seconds["restore, from S3"]
        ),
    }
    for name, peer in report.get("peers", {}).items():
        if peer["ran"]:
            found[name] = memory(peer["seconds"])
    return found


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _target(name: str, ratio: float, goal: float) -> dict[str, Any]:
    return {"target": name, "ratio": ratio, "goal": f"<= {goal}"}


def table(report: dict[str, Any]) -> str:
    lines = [
        f"memory tier: 2 ranks x {report['size_mib']} MiB ({report['tensors']} tensors), "
        f"two simulated nodes, zero-cost S3",
        f"{'measure (seconds)':<40} {'s3ckpt':>9}",
    ]
    peers = {name: peer for name, peer in report.get("peers", {}).items() if peer["ran"]}
    lines[-1] += "".join(f" {name:>11}" for name in peers)
    for name, value in report["seconds"].items():
        theirs = "".join(f" {_cell(peer['seconds'].get(name)):>11}" for peer in peers.values())
        lines.append(f"{name:<40} {value:>9.3f}{theirs}")
    shm = ", ".join(f"{b / (1 << 20):.0f} MiB" for b in report["shm_bytes_per_node"])
    lines.append(
        f"shared memory per node: {shm} (state {report['state_bytes_per_rank'] / (1 << 20):.0f}"
        f" MiB per rank; keep=2 own copies + 2 replicas)"
    )
    lines.append(f"restored from: {report['sources']}; bit-exact: {report['exact']}")
    for source, found in report.get("resharded", {}).items():
        lines.append(
            f"{'one rank restores both (' + source + ')':<40} {found['total_s']:>9.3f}"
            f"  from {found['tier']}, bit-exact: {found['exact']}"
        )
    lines += [
        f"{t['target']:<40} {t['ratio']:>9.2f}  (goal {t['goal']})" for t in report["targets"]
    ]
    beside = report["loop_beside_replication"]
    lines.append(
        f"dispatch loop beside a save held and replicated: {beside['slowdown']:+.0%} (slowest rank)"
    )
    for name, peer in report.get("peers", {}).items():
        if peer["ran"]:
            shm = ", ".join(f"{b / (1 << 20):.0f} MiB" for b in peer["shm_bytes_per_node"])
            lines.append(f"{name}: shared memory per node {shm}; bit-exact: {peer['exact']}")
        else:
            lines.append(f"{name}: not run ({peer['why'].strip().splitlines()[-1]})")
    lost = report.get("steps_lost")
    if lost:
        lines.append(
            f"steps lost per failure (mean; a step {lost['step_s']} s, memory every "
            f"{lost['every']} steps, S3 every {lost['s3_every']}):"
        )
        lines.append(f"  {'':<38} {'restarted':>9} {'node lost':>9}")
        for name, value in lost.items():
            if isinstance(value, list | tuple):
                lines.append(f"  {name:<38} {value[0]:>9.1f} {value[1]:>9.1f}")
            elif name not in ("step_s", "every", "s3_every"):
                lines.append(f"  {name:<38} {value:>9.1f} {value:>9.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
