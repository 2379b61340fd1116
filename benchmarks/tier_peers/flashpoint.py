"""Google's ML Flashpoint (``ml-flashpoint`` 0.0.10) measured as benchmarks.memory_tier
measures s3ckpt's memory tier: two gloo ranks, each on a simulated node of its own, each
with ``size_mib`` of state in ``tensors`` float32 tensors, replicated to the peer node.

ML Flashpoint is not in the project's environment: it runs from its own virtual
environment, ``.venv-flashpoint``, so run this module with that interpreter:

    .venv-flashpoint/bin/python -m benchmarks.tier_peers.flashpoint [--size-mib 256]

PyPI has only its sdist, whose CMake build clones abseil-cpp (and googletest) with
FetchContent, and whose non-editable wheel leaves out the two compiled extensions (no
install() rule, and ``*.so`` is in its .gitignore), so it is installed editable from the
unpacked sdist against a local source tree of abseil-cpp at tag 20250814.1 (the one the
sdist pins; abseil is on no package registry, so ``make bench`` cannot build this
environment by itself; ``ABSEIL_SRC`` is that tree):

    python -m venv .venv-flashpoint
    .venv-flashpoint/bin/pip install torch==2.13.0 numpy==2.4.6
    .venv-flashpoint/bin/pip install --no-deps -e .venv-flashpoint/src/ml_flashpoint-0.0.10 \
        --config-settings=cmake.define.BUILD_TESTING=OFF \
        --config-settings=cmake.define.FETCHCONTENT_SOURCE_DIR_ABSEIL-CPP=ABSEIL_SRC \
        --config-settings=cmake.define.FETCHCONTENT_FULLY_DISCONNECTED=ON

Its save is the one its Megatron adapter runs (``MLFlashpointMegatronAsyncSaveStrategy``)
with PyTorch DCP's default planner in place of Megatron's: ``initialize_checkpoint``,
``generate_plan``, ``stage_write_data_buckets`` (the blocking part), then
``write_data`` into the node's buffer objects, ``replicate_written_objects`` to the peer,
``finish_write`` (the metadata on each node) and ``finalize_checkpoint`` (the dirty marker
removed, a barrier, older steps removed). The restore is
``DefaultMLFlashpointCheckpointLoader.get_latest_complete_checkpoint`` (which fetches what
a rank lacks from a peer) and ``dcp.load`` with its ``MemoryStorageReader``.

Simulated nodes: ML Flashpoint names a checkpoint by one absolute path on every node and
a replica lands on the peer under the same path as the original, so two ranks on one
machine cannot share a folder (the replica would overwrite the sender's own object).
Each rank therefore enters a mount namespace of its own and bind-mounts its node's folder
(``root/flashpoint-node{rank}``) on the one path both use (``root/flashpoint-mount``);
this needs root (CAP_SYS_ADMIN).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import os
import shutil
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.tier_peers import run_pair

MOUNT = "flashpoint-mount"


def rank_main(
    rank: int, world: int, port: int, root: str, out: str, size_mib: int, tensors: int,
    saves: int,
) -> None:  # fmt: skip
    """One spawned rank: its own TCPStore client on ``port``, gloo, then saves, restores
    from the own copy and from the peer after node 1 is lost; writes
    ``out/flashpoint-rank{rank}.json``."""
    notes: list[str] = []
    result: dict[str, Any] = {"rank": rank, "notes": notes}
    path = Path(out, f"flashpoint-rank{rank}.json")
    try:
        _run(rank, world, port, Path(root), size_mib, tensors, saves, result, notes)
    except BaseException as exc:  # the report says why rather than the rank vanishing
        notes.append(f"failed: {type(exc).__name__}: {exc}")
        path.write_text(json.dumps(result, default=str))
        raise
    path.write_text(json.dumps(result, default=str))


def _run(
    rank: int, world: int, port: int, root: Path, size_mib: int, tensors: int, saves: int,
    result: dict[str, Any], notes: list[str],
) -> None:  # fmt: skip
    # Environment ML Flashpoint reads: its own log level (DEBUG by default, a line per
    # call), the node count (else it divides the world by torch.cuda.device_count(),
    # which raises on CPU), and the node-local rank (torch.distributed.get_node_local_rank
    # reads LOCAL_RANK): one rank per simulated node, so 0 on both.
    os.environ.update(
        MLFLASHPOINT_LOG_LEVEL="WARNING",
        NNODES=str(world),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    node = root / f"flashpoint-node{rank}"
    mount = root / MOUNT
    node.mkdir(parents=True, exist_ok=True)
    mount.mkdir(parents=True, exist_ok=True)
    _own_node_view(node, mount)  # before any thread that touches files is started

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    try:
        _measure(rank, world, node, mount, size_mib, tensors, saves, result, notes)
    finally:
        dist.destroy_process_group()


def _own_node_view(node: Path, mount: Path) -> None:
    """This process (and what it starts from now on) sees ``node`` at ``mount``."""
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_private, ms_bind = 0x20000, 0x4000, 1 << 18, 0x1000

    def check(code: int, what: str) -> None:
        if code != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)} (needs root / CAP_SYS_ADMIN)")

    check(libc.unshare(clone_newns), "unshare(CLONE_NEWNS)")
    check(libc.mount(None, b"/", None, ms_rec | ms_private, None), "mount --make-rprivate /")
    check(libc.mount(bytes(node), bytes(mount), None, ms_bind, None), "mount --bind")


def _patch_flashpoint() -> None:
    """Runtime patches, in this process only (site-packages untouched)."""
    from ml_flashpoint.replication import replication_manager as rm

    # 1. The default strategy is built as PairwiseReplicationStrategy(addresses,
    #    torch.cuda.device_count()): 0 processes per node on CPU, a modulo by zero. Here
    #    one process per (simulated) node.
    class OneRankPerNode(rm.PairwiseReplicationStrategy):
        def __init__(self, addresses: list[str], processes_per_node: int) -> None:
            super().__init__(addresses, 1)

    rm.PairwiseReplicationStrategy = OneRankPerNode

    # 2. Each rank advertises socket.gethostbyname(socket.gethostname()) to its peers;
    #    here the peers are on this machine, so loopback, whatever the hostname resolves
    #    to. (The C++ service connects only to the addresses Python gives it.)
    def loopback(self: Any) -> None:
        self._hostname = "127.0.0.1"

    rm.ReplicationManager._initialize_address = loopback


def _measure(
    rank: int, world: int, node: Path, mount: Path, size_mib: int, tensors: int, saves: int,
    result: dict[str, Any], notes: list[str],
) -> None:  # fmt: skip
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as tmp

    _patch_flashpoint()
    from ml_flashpoint.adapter.pytorch.memory_storage_writer import MemoryStorageWriter
    from ml_flashpoint.checkpoint_object_manager.checkpoint_object_manager import (
        CheckpointObjectManager,
    )
    from ml_flashpoint.core.checkpoint_id_types import CheckpointContainerId
    from ml_flashpoint.core.checkpoint_saver import DefaultMLFlashpointCheckpointSaver
    from ml_flashpoint.replication.replication_manager import ReplicationManager

    numel = size_mib * (1 << 20) // 4 // tensors
    state = {f"rank{rank}.layer{i}": torch.randn(numel) for i in range(tensors)}
    nbytes = numel * 4 * tensors
    result["bytes"] = nbytes
    result["copy_steady_s"] = _bare_copy(state)

    objects = CheckpointObjectManager()
    replication = ReplicationManager()
    replication.initialize(objects)  # its C++ TransferService: 2 x 16 threads, a port
    saver = DefaultMLFlashpointCheckpointSaver(
        global_rank_getter=dist.get_rank,
        local_rank_getter=dist.get_node_local_rank,
        global_barrier_func=dist.barrier,
        ckpt_obj_manager=objects,
        replication_manager=replication,
    )
    manager: concurrent.futures.Future = concurrent.futures.Future()
    manager.set_result(tmp.get_context("spawn").Manager())  # MemoryStorageWriter needs one
    base = CheckpointContainerId(str(mount / "job"))
    phases = []
    for step in range(1, saves + 1):
        dist.barrier()
        phases.append(_save(step, state, base, saver, manager, MemoryStorageWriter))
    dist.barrier()
    result["blocked_first_s"] = phases[0]["blocked_s"]
    # steady: from the third save on, as benchmarks.memory_tier
    result["blocked_steady_s"] = statistics.median(p["blocked_s"] for p in phases[2:saves])
    result["held_s"] = statistics.median(p["held_s"] for p in phases)
    replicated = [p["replicated_s"] for p in phases]
    result["replicated_s"] = None if None in replicated else statistics.median(replicated)
    if result["replicated_s"] is None:
        notes.append("a replication failed: " + "; ".join(p["error"] for p in phases if p["error"]))
    result["phases"] = phases
    result["shm_bytes"] = _node_bytes(node)
    result["held_steps"] = sorted(p.name for p in (mount / "job").iterdir() if p.is_dir())

    result["own"] = _restore(base, replication, state, saves)
    dist.barrier()
    if rank == 1:  # node 1 lost: its memory is empty when its process comes back
        for child in mount.iterdir():
            if child.is_dir():
                shutil.rmtree(child)
            else:
                child.unlink()
    dist.barrier()
    try:
        result["peer"] = _restore(base, replication, state, saves)
    except Exception as exc:
        result["peer"] = {"error": f"{type(exc).__name__}: {exc}"}
    dist.barrier()
    replication.shutdown()
    notes += [
        "save = its Megatron adapter's sequence with DCP's DefaultSavePlanner, run in "
        "the rank's own process, each phase timed from the save's start",
        "blocked = initialize_checkpoint + generate_plan (DCP planning, all-gathers) + "
        "stage_write_data_buckets (tensor.to('cpu', non_blocking=True): no copy for CPU "
        "tensors, so on CPU nothing is snapshotted before the write; on a GPU this is the "
        "device-to-host copy) + an empty common.pt per node (what Megatron's common "
        "state would be; its loader needs one on every node)",
        "held = + write_data (the copy into the node's buffer objects in /dev/shm) + "
        "replicate_written_objects started + finish_write (metadata on each node) + "
        "finalize_checkpoint (dirty marker removed, a barrier): restorable from the own copy",
        "replicated = until the futures replicate_written_objects returned are done "
        "(its adapters discard them: fire-and-forget)",
        "keeps 1 step: finalize_checkpoint removes all older steps (no keep=2)",
        "restores: a fresh CheckpointObjectManager and loader, the rank's ReplicationManager "
        "(TransferService) kept, as it must serve the peer; select = "
        "get_latest_complete_checkpoint, which also fetches from the peer what a rank lacks",
        "runtime patches: PairwiseReplicationStrategy with 1 process per node (it divides by "
        "torch.cuda.device_count(), 0 on CPU); advertised address 127.0.0.1",
    ]


def _save(
    step: int, state: dict[str, Any], base: Any, saver: Any, manager: Any, writer_cls: Any
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from ml_flashpoint.adapter.pytorch import custom_state_dict_saver as statedictsaver
    from ml_flashpoint.core.checkpoint_id_types import CheckpointContainerId
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.utils import _DistWrapper

    cid = CheckpointContainerId.create_child(
        base, CheckpointContainerId.format_version_container(step)
    )
    wrapper = _DistWrapper(group=None, use_dist=True, coordinator_rank=0)
    start = time.perf_counter()
    saver.initialize_checkpoint(cid)
    writer = writer_cls(checkpoint_saver=saver, mp_manager_future=manager, thread_count=1)
    writer.reset(cid.data)
    buckets, metadata, *_ = statedictsaver.generate_plan(
        checkpoint_id=cid, state_dict=state, storage_writer=writer,
        planner=DefaultSavePlanner(), world_dist_wrapper=wrapper,
    )  # fmt: skip
    staged = writer.stage_write_data_buckets(cid, buckets, non_blocking=True)
    if dist.get_node_local_rank() == 0:
        torch.save({}, os.path.join(cid.data, "common.pt"))
    blocked = time.perf_counter() - start
    statedictsaver.write_data(
        checkpoint_id=cid, storage_writer=writer, staged_write_buckets=staged,
        replicate_after_write=False,
    )  # fmt: skip
    written = time.perf_counter() - start
    futures = writer.replicate_written_objects({b.object_id for b in staged})
    statedictsaver.finish_write(
        checkpoint_id=cid, storage_writer=writer, global_metadata=metadata,
        world_dist_wrapper=wrapper,
    )  # fmt: skip
    removal = saver.finalize_checkpoint(cid)
    held = time.perf_counter() - start
    done, _ = concurrent.futures.wait(futures, timeout=120)
    replicated: float | None = time.perf_counter() - start
    error = ""
    for future in futures:
        if future not in done:
            error = "timed out after 120 s"
        elif future.exception() is not None:
            error = f"{future.exception()}"
        elif not future.result().success:
            error = future.result().error_message
    if error or not futures:
        replicated, error = None, error or "no replication started"
    if removal is not None:
        removal.wait()  # older steps removed (its rm -rf in the background)
    dist.barrier()  # the peer's replica of this step is in, before the next save
    return {
        "step": step,
        "blocked_s": blocked,
        "written_s": written,
        "held_s": held,
        "replicated_s": replicated,
        "error": error,
    }


def _restore(base: Any, replication: Any, like: dict[str, Any], expect: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ml_flashpoint.adapter.pytorch.memory_storage_reader import MemoryStorageReader
    from ml_flashpoint.checkpoint_object_manager.checkpoint_object_manager import (
        CheckpointObjectManager,
    )
    from ml_flashpoint.core.checkpoint_id_types import CheckpointContainerId
    from ml_flashpoint.core.checkpoint_loader import DefaultMLFlashpointCheckpointLoader

    fetched: list[float] = []

    class Loader(DefaultMLFlashpointCheckpointLoader):
        """Its loader, with the time of the fetch from peers taken."""

        def retrieve_checkpoint(self, plan: Any) -> bool:
            start = time.perf_counter()
            try:
                return super().retrieve_checkpoint(plan)
            finally:
                fetched.append(time.perf_counter() - start)

    state = {k: torch.zeros_like(v) for k, v in like.items()}
    loader = Loader(
        checkpoint_object_manager=CheckpointObjectManager(),
        replication_manager=replication,
        global_rank_getter=dist.get_rank,
        local_rank_getter=dist.get_node_local_rank,
        broadcast_object_list_func=dist.broadcast_object_list,
        all_gather_object_func=dist.all_gather_object,
        world_size_getter=dist.get_world_size,
    )
    step_dir = Path(base.data) / CheckpointContainerId.format_version_container(expect)
    own = f"src{dist.get_rank()}"
    had = step_dir.is_dir() and any(own in p.name for p in step_dir.iterdir())
    dist.barrier()
    start = time.perf_counter()
    latest = loader.get_latest_complete_checkpoint(base)
    select = time.perf_counter() - start
    if latest is None:
        return {"error": "get_latest_complete_checkpoint found no complete checkpoint"}
    dcp.load(state, checkpoint_id=str(latest), storage_reader=MemoryStorageReader(
        path=str(latest), checkpoint_loader=loader))  # fmt: skip
    total = time.perf_counter() - start
    exact = all(torch.equal(state[k], like[k]) for k in like)
    step = CheckpointContainerId.parse_version_container_step(Path(latest.data).name)
    return {
        "tier": "memory" if had else "peer",
        "total_s": total,
        "select_s": select,
        "fetch_s": fetched[0] if fetched else 0.0,
        "step": step,
        "exact": exact and step == expect,
    }


def _bare_copy(state: dict[str, Any]) -> float:
    """A copy of the state into memory already touched, both ranks at once."""
    import torch
    import torch.distributed as dist

    copies = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():
        copies[k].copy_(v)
    dist.barrier()
    start = time.perf_counter()
    for k, v in state.items():
        copies[k].copy_(v)
    return time.perf_counter() - start


def _node_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--out", type=Path, help="keep the two ranks' JSON here")
    args = parser.parse_args(argv)
    ranks = run_pair("flashpoint", rank_main, args.size_mib, args.tensors, args.saves, args.out)
    print(json.dumps({k: v for k, v in ranks[0].items() if k != "notes"}, indent=1))
    print(json.dumps({k: v for k, v in ranks[1].items() if k != "notes"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
