"""NVIDIA Resiliency Extension (NVRx) local checkpoints, measured like the memory tier.

The same state, ranks and quantities as :mod:`benchmarks.memory_tier`, with NVRx's
``LocalCheckpointManager`` (``nvidia_resiliency_ext.checkpointing.local``) and a
``CliqueReplicationStrategy`` that puts each rank's replica on the other simulated node. Two
gloo ranks, each on a node of its own (``root/node{rank}``, a folder of /dev/shm), each with
``--size-mib`` MiB of float32 state in ``--tensors`` tensors. Per rank:

* save blocking (``save(is_async=True)`` plus scheduling the async write; the first save,
  then the median from the third on): the replication's all-gather runs inside it
  (``replicate_steady_s``: its share, median from the third save on);
* ``held_s``: from the blocking part's return until the async save is finalized (written,
  checked on every rank by ``find_latest``); ``written_s``: until this rank's writer process
  exited; ``replicated_s``: until the replica is on the peer's node (NVRx writes it in the
  peer's same writer process, so it equals ``held_s``);
* restores with a new manager: from the own copy, then after node 1 is lost (its folder
  removed) from the peer's replica; ``find_latest`` is the step selection; bit-exactness;
* ``shm_bytes``: bytes allocated under the node's folder after the saves.

NVRx 0.4.1 keeps only the newest iteration (its cleanup removes every older one), not two.

Install (PyPI has 0.1.3 to 0.4.1; 0.4.1 is the newest there). Never let pip resolve torch
unpinned, it would fetch a CUDA build; 0.4.1 imports numpy without declaring it, and its
declared pynvml, nvidia-ml-py, psutil, pyyaml, defusedxml and packaging are not used here::

    python3 -m venv .venv-tierpeers
    .venv-tierpeers/bin/pip install torch==2.13.0
    .venv-tierpeers/bin/pip install --no-deps nvidia-resiliency-ext==0.4.1
    .venv-tierpeers/bin/pip install torch==2.13.0 numpy==2.4.6
    .venv-tierpeers/bin/python -m benchmarks.tier_peers.nvrx [--size-mib 256] [--tensors 16]

What NVRx assumes a GPU for, and what this module does about it on CPU (each patched at
runtime inside the rank processes, never in site-packages; see :func:`_patch_for_cpu`):

* ``BasicTensorAwareStateDict`` asserts every tensor is CUDA and restores to "cuda":
  :class:`CpuStateDict` is a ``TensorAwareStateDict`` for CPU state (its extension point, not
  a patch); its ``copy_tensors_to_cpu`` clones, the CPU stand-in for the D2H copy into fresh
  host memory that NVRx makes on every save;
* ``torch.cuda.synchronize()`` (after the D2H copy, in ``save`` and in the writer's fork)
  raises on a CPU-only torch: made a no-op (no device, nothing to wait for);
* the async queue's all-reduces put their flag on ``torch.cuda.current_device()``: done
  on a CPU tensor over gloo instead;
* a restore from a peer sends and receives every tensor through ``.cuda()``
  (``GroupWrapper.isend_state_dict``/``irecv_state_dict``): first run as is (the error goes
  to the notes), then with CPU tensors sent over gloo directly;
* the default persistent writer (``AsyncCallsQueue(persistent=True)``) pickles the request,
  whose ``async_fn`` is the manager's bound method holding the ProcessGroup: it cannot be
  pickled (checked, into the notes; sent for real, the queue's feeder thread drops it and the
  trainer would wait for ever), so the forked ``TemporalAsyncCaller`` (``persistent=False``)
  writes instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import pickle
import shutil
import statistics
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
    BasicTensorAwareStateDict,
    dict_list_map_inplace,
)

from benchmarks.tier_peers import run_pair

SESSION = "bench"


class CpuStateDict(BasicTensorAwareStateDict):
    """``BasicTensorAwareStateDict`` for CPU tensors: the base asserts each is CUDA."""

    def __init__(self, state_dict: dict[str, Any]) -> None:
        self.state_dict = state_dict
        self._is_hollow = False

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """The D2H copy's stand-in: a snapshot into fresh host memory (``.to("cpu")`` of a
        CPU tensor would return the tensor itself, and the writer would read live state)."""
        assert not self.is_hollow
        dict_list_map_inplace(
            lambda x: x.clone() if isinstance(x, torch.Tensor) else x, self.state_dict
        )

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """The state lives on the CPU: nothing to move."""


def rank_main(
    rank: int, world: int, port: int, root: str, out: str, size_mib: int, tensors: int,
    saves: int,
) -> None:  # fmt: skip
    """One spawned rank: saves, restores and writes ``out/nvrx-rank{rank}.json``."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager,
    )
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
        CliqueReplicationStrategy,
    )

    notes = _patch_for_cpu()
    torch.set_num_threads(1)
    # NVRx's object send/recv ask torch for a group's default device the deprecated way
    warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*")
    warnings.filterwarnings("ignore", message="Multiple backends are registered.*")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    numel = size_mib * (1 << 20) // 4 // tensors
    state = {f"rank{rank}.layer{i}": torch.randn(numel) for i in range(tensors)}
    node = Path(root) / f"node{rank}"
    result: dict[str, Any] = {"rank": rank, "bytes": numel * 4 * tensors}
    # jump 1, factor 2: ranks 0 and 1 (one per simulated node) hold each other's replica
    strategy = CliqueReplicationStrategy.from_replication_params(
        replication_jump=1, replication_factor=2
    )
    manager = LocalCheckpointManager(node, session_id=SESSION, repl_strategy=strategy)
    notes.append(_persistent_writer_check(manager))
    replicating = _timed(strategy, "replicate")  # its share of the blocking save
    queue = AsyncCallsQueue(persistent=False)
    blocked, written, held = [], [], []
    for step in range(1, saves + 1):
        dist.barrier()
        start = time.perf_counter()
        # a shallow copy: NVRx makes the dict it is given hollow (its tensors popped)
        request = manager.save(CpuStateDict(dict(state)), step, is_async=True)
        queue.schedule_async_request(request)
        returned = time.perf_counter()
        queue.async_calls[-1].async_caller.process.join()  # this rank's writer is done
        done = time.perf_counter()
        queue.maybe_finalize_async_calls(blocking=True)
        finalized = time.perf_counter()
        blocked.append(returned - start)
        written.append(done - returned)
        held.append(finalized - returned)
    queue.close()
    result["blocked_first_s"] = blocked[0]
    result["blocked_steady_s"] = statistics.median(blocked[2:]) if saves > 2 else blocked[-1]
    result["replicate_steady_s"] = statistics.median(replicating[2:] or replicating)
    result["written_s"] = statistics.median(written)
    result["held_s"] = statistics.median(held)
    result["replicated_s"] = result["held_s"]
    notes += [
        "replication (CliqueReplicationStrategy.replicate: all_gather_object of the hollow "
        "state dict, then one broadcast per tensor) runs inside the blocking save; "
        "replicated_s is when the peer's writer has written the replica it received then "
        "(the same writer process and finalize as its own copy, so equal to held_s)",
        "held_s/replicated_s/written_s count from the blocking save's return, as s3ckpt's "
        "metrics do; held_s is finalize (maybe_finalize_async_calls(blocking=True): the "
        "all-reduce of the writers' state, find_latest's all_gather, cleanup of older "
        "iterations started in a thread)",
        "NVRx 0.4.1 keeps one iteration (own copy + the peer's replica) per node; it has no keep=2",
    ]
    result["shm_bytes"] = _node_bytes(node, saves)
    result["own"] = _restore(rank, node, strategy, state)
    dist.barrier()
    if rank == 1:
        shutil.rmtree(node)  # node 1 lost
    try:
        result["peer"] = _restore(rank, node, strategy, state)
        notes.append("peer restore ran without the .cuda() patch")
    except Exception as error:  # the expected failure on CPU: recorded, then patched
        notes.append(f"peer restore as shipped: {type(error).__name__}: {error}")
        dist.barrier()
        notes.append(_patch_peer_exchange_for_cpu())
        try:
            result["peer"] = _restore(rank, node, strategy, state)
        except Exception as again:
            result["peer"] = {"error": f"{type(again).__name__}: {again}"}
    result["notes"] = notes
    Path(out, f"nvrx-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _restore(rank: int, node: Path, strategy: Any, like: dict[str, Any]) -> dict[str, Any]:
    """``find_latest`` and ``load`` with a new manager (the process group and replication
    strategy kept: they are the job's, not the checkpoint's), then the loaded tensors copied
    into the state (s3ckpt's ``load_latest`` fills the given tensors)."""
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager,
    )

    state = {k: torch.zeros_like(v) for k, v in like.items()}
    manager = LocalCheckpointManager(node, session_id=SESSION, repl_strategy=strategy)
    dist.barrier()
    start = time.perf_counter()
    step = manager.find_latest()
    select = time.perf_counter() - start
    own_file = manager._local_ckpt_path_from_id(manager._ckpt_id(step)).exists()
    loaded, _ = manager.load()
    for key, value in loaded.state_dict.items():
        state[key].copy_(value)
    total = time.perf_counter() - start
    exact = all(torch.equal(state[k], like[k]) for k in like)
    tier = "own copy" if own_file else "peer's replica"
    return {"tier": tier, "step": step, "total_s": total, "select_s": select, "exact": exact}


def _timed(owner: Any, name: str) -> list[float]:
    """Times each call of ``owner.name`` (an instance attribute over the method; timing only)."""
    method, seconds = getattr(owner, name), []

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(owner, name, timed)
    return seconds


def _node_bytes(node: Path, newest: int) -> int:
    """Bytes allocated under the node's folder once the cleanup thread (started by finalize)
    has removed the iterations older than ``newest``."""
    stale = [f"iter_{step:07d}_" for step in range(1, newest)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        files = [p for p in node.rglob("*") if p.is_file()]
        if not any(p.name.startswith(tuple(stale)) for p in files):
            break
        time.sleep(0.05)
    return sum(p.stat().st_blocks * 512 for p in files)


def _persistent_writer_check(manager: Any) -> str:
    """Whether the persistent writer could take a request: it pickles ``async_fn``."""
    try:
        pickle.dumps(manager._save_fn)
    except Exception as error:
        return (
            f"AsyncCallsQueue(persistent=True) unusable: the request's async_fn "
            f"(manager._save_fn) does not pickle ({type(error).__name__}: {error}); "
            f"used persistent=False (TemporalAsyncCaller, a forked writer per save)"
        )
    return "manager._save_fn pickles; persistent=False used all the same"


def _patch_for_cpu() -> list[str]:
    """Runtime patches for a CPU-only torch with gloo (this process only)."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt import core

    notes = []
    if not torch.cuda.is_available():
        # BaseCheckpointManager.save(is_async=True) and TemporalAsyncCaller wait for the D2H
        # copy with torch.cuda.synchronize(), which raises without CUDA; the CPU "copy"
        # (CpuStateDict.copy_tensors_to_cpu) is synchronous, so there is nothing to wait for.
        torch.cuda.synchronize = lambda device=None: None
        notes.append("patched torch.cuda.synchronize to a no-op (raises on CPU-only torch)")

    def sync_all_async_calls(self: Any, is_alive: int) -> bool:
        # as core.AsyncCaller.sync_all_async_calls, the flag on the CPU (gloo) rather than
        # on torch.cuda.current_device(), which raises without CUDA
        flag = torch.tensor([is_alive], dtype=torch.int)
        dist.all_reduce(flag)
        return bool(flag[0] == 0)

    def execute_finalize_fns(self: Any, validate_matching_call_idx: bool = True) -> int:
        # as core.AsyncRequest.execute_finalize_fns, its all-reduce on a CPU tensor
        for finalize_fn in self.finalize_fns:
            finalize_fn()
        if validate_matching_call_idx:
            index = torch.tensor([self.call_idx], dtype=torch.int)
            dist.all_reduce(index, op=dist.ReduceOp.MAX)
            assert index.item() == self.call_idx, "Unmatched async calls."
        return self.call_idx

    core.AsyncCaller.sync_all_async_calls = sync_all_async_calls
    core.AsyncRequest.execute_finalize_fns = execute_finalize_fns
    notes.append(
        "patched AsyncCaller.sync_all_async_calls and AsyncRequest.execute_finalize_fns: "
        "their all-reduce tensors on CPU, not torch.cuda.current_device()"
    )
    notes.append(
        "CpuStateDict (a TensorAwareStateDict) instead of BasicTensorAwareStateDict, which "
        "asserts CUDA tensors; its copy_tensors_to_cpu clones (the D2H copy's stand-in)"
    )
    # the TemporalAsyncCaller warns at every save that it will be deprecated
    logging.getLogger(core.__name__).setLevel(logging.ERROR)
    return notes


def _patch_peer_exchange_for_cpu() -> str:
    """A restore from a peer as NVRx does it, with CPU tensors sent over gloo as they are."""
    from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import GroupWrapper

    def isend_state_dict(self: Any, state_dict: Any, dst: int) -> dict[str, float]:
        # as GroupWrapper.isend_state_dict without ten.cuda() (NCCL sends GPU tensors)
        tensor_data = state_dict.pop_tensors()
        self.send_object(state_dict, dst)
        for ten in tensor_data:
            dist.send(ten, dst, group=self.group)
        state_dict.insert_tensors(tensor_data)
        return {"data_sent": sum(ten.nbytes for ten in tensor_data)}

    def irecv_state_dict(self: Any, src: int) -> tuple[Any, dict[str, float]]:
        # as GroupWrapper.irecv_state_dict, received into the CPU tensor itself rather than
        # into a CUDA buffer copied back
        hollow = self.recv_object(src)
        hollow.init_tensors()
        for ten in hollow.tensors:
            dist.recv(ten, src, group=self.group)
        return hollow, {"data_recv": sum(ten.nbytes for ten in hollow.tensors)}

    GroupWrapper.isend_state_dict = isend_state_dict
    GroupWrapper.irecv_state_dict = irecv_state_dict
    return (
        "patched GroupWrapper.isend_state_dict/irecv_state_dict: CPU tensors over gloo "
        "(as shipped each tensor goes through .cuda() / a CUDA receive buffer)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--out", type=Path, help="keep nvrx-rank{0,1}.json here")
    args = parser.parse_args(argv)
    if args.saves < 3:
        parser.error("--saves must be at least 3 (the steady figure is from the third on)")
    ranks = run_pair("nvrx", rank_main, args.size_mib, args.tensors, args.saves, args.out)
    print(json.dumps(ranks, indent=2))
    return 0


if __name__ == "__main__":
    from benchmarks.tier_peers.nvrx import main as _main  # spawned ranks find it by this name

    raise SystemExit(_main())
