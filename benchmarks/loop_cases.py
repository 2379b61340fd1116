"""One case of the ``loop`` benchmark: ``python -m benchmarks.loop_cases LOOP MODE PLACEMENT``.

A training loop steps alone, then while a save of the state uploads beside it, then alone
again; printed as one JSON line. ``LOOP``: ``dispatch`` (small torch ops and a little
Python per step, one thread: how a GPU trainer's Python thread spends its time launching
kernels) or ``compute`` (a small MLP's forward and backward). ``MODE``: how the save runs
(:data:`MODES`). ``PLACEMENT``: ``shared`` (every thread on both cores) or ``pinned``
(the loop's thread alone on CPU 0; every other thread, child process and the server on
CPU 1), so that the loop competes for the GIL and not for a core.

The state is saved as ``{"model": state}`` (``BENCH_STATE=nested``, the default), the shape
trainers and the quickstart give DCP: a few top-level entries. ``BENCH_STATE=flat`` saves
the tensors as top-level entries. DCP's ``save`` wraps every top-level entry in its
method logger (two log records and a UUID) and checks it for ``Stateful``
(``inspect.getattr_static``): in thread mode that runs on the save's thread beside the
loop, about 35 ms of Python per save for this state's 580 tensors, none of it the
storage's.

Per rep: the loop's time per step alone and during the upload, the time the save call
blocked, the upload's time, and the loop time lost:
``blocked + upload x (1 - step alone / step during)``; and each of these over a bare copy
of the state timed just before the save, on the save's core (``copy_s``; the host's
memory bandwidth drifts too much for one copy per case to serve every rep). A warm-up
save runs first (a training loop's saves after its first are what matter). Environment:
that of :mod:`benchmarks.cases`.

A step's slowdown has two factors, and each rep measures both from the loop thread's own
CPU time (:func:`time.thread_time`) and its voluntary context switches:

- ``waiting``: the step's wall time over its CPU time during the upload, minus one. A
  thread alone on its core is off it only while it sleeps, and beside a thread-mode save
  it sleeps waiting for the GIL (``sleeps`` counts them): what the save's own threads
  cost the loop. Its slowdown on a host where the loop's CPU per step stays as it was;
  ``lost_waiting_s_per_gib`` is the loop time lost counted the same way (the time
  blocked, and the upload's time off the core: ``upload x waiting / (1 + waiting)``);
- ``cpu_growth``: the step's CPU time during the upload over alone, minus one. On a
  shared host it moves with the neighbours (caches, memory bandwidth, the hypervisor),
  beside the checkpoint process as much as beside a thread; ``alone_drift`` (the step
  alone after the upload over before it, minus one) shows how far it moves with nothing
  saving at all.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.data import BareCopy, make_state, state_nbytes
from benchmarks.loop_floors import NativeBatchWriter, ProcessFloor, RawSocketWriter, ViewingWriter

warnings.filterwarnings("ignore")
GiB = 1024**3
ALONE_S = float(os.environ.get("BENCH_LOOP_ALONE_S", "2.0"))
LOOP_CPU, OTHERS_CPU = {0}, {1}
STATE_SHAPES = ("nested", "flat")


# -- the loops ---------------------------------------------------------------------------


def dispatch_loop() -> Callable[[], None]:
    """Ten small torch ops on 32x32 tensors and about two hundred lines' worth of Python:
    every op lets the GIL go and takes it back."""
    a, b = torch.randn(32, 32), torch.empty(32, 32)
    table: dict[int, int] = {}

    def step() -> None:
        for _ in range(5):
            b.copy_(a).mul_(1.0001)
        total = 0
        for i in range(200):
            total += i * i
            table[i & 63] = total

    return step


def compute_loop() -> Callable[[], None]:
    """A small MLP's forward, backward and optimizer step (one intra-op thread)."""
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(64, 256)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(batch).square().mean().backward()
        optimizer.step()

    return step


LOOPS = {"dispatch": dispatch_loop, "compute": compute_loop}


# -- the ways a save runs beside the loop: (start a save of ``state``) -> wait-able ------


def _uri(name: str, i: int) -> str:
    return f"s3://{os.environ['BENCH_BUCKET']}/{os.environ['BENCH_PREFIX']}/{name}/{i}"


def _endpoint() -> dict[str, Any]:
    return {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}


def manager(async_mode: str) -> Callable[[], Callable[[dict, int], Any]]:
    def make() -> Callable[[dict, int], Any]:
        from s3ckpt import CheckpointManager

        m = CheckpointManager(_uri(f"manager-{async_mode}", 0), async_mode=async_mode,
                              **_endpoint())  # fmt: skip

        def save(state: dict, i: int) -> Any:
            m.save(i, state)
            return _Waiter(lambda: not m.busy, m.wait)

        return save

    return make


def checkpoint_process() -> Callable[[dict, int], Any]:
    from s3ckpt import CheckpointProcess, S3StorageWriter

    process = CheckpointProcess()

    def save(state: dict, i: int) -> Any:
        writer = S3StorageWriter(_uri("checkpoint-process", i), **_endpoint())
        return process.async_save(state, storage_writer=writer)

    return save


def dcp_thread(
    writer_of: Callable[[int], Any], stager: Any = None, planner: Any = None
) -> Callable[[dict, int], Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    def save(state: dict, i: int) -> Any:
        response = dcp.async_save(
            state, storage_writer=writer_of(i), async_stager=stager, planner=planner,
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
        )  # fmt: skip
        return getattr(response, "upload_completion", response)

    return save


def s3ckpt_dcp_thread() -> Callable[[dict, int], Any]:
    from s3ckpt import S3StorageWriter

    return _s3ckpt_staged(lambda i: S3StorageWriter(_uri("dcp-thread", i), **_endpoint()))


def floor(writer: type[ViewingWriter]) -> Callable[[], Callable[[dict, int], Any]]:
    """``dcp_thread`` with a storage that does less than any store client (loop_floors)."""
    return lambda: _s3ckpt_staged(lambda i: writer())


def _s3ckpt_staged(writer_of: Callable[[int], Any]) -> Callable[[dict, int], Any]:
    """Thread-mode ``dcp.async_save`` as README asks of its users: one ``HostStager`` and
    one ``ReusingSavePlanner`` for every save."""
    from s3ckpt import HostStager, ReusingSavePlanner

    return dcp_thread(writer_of, HostStager(), ReusingSavePlanner())


def s3ckpt_dcp_process() -> Callable[[dict, int], Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from s3ckpt import S3StorageWriter

    port = _free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    def save(state: dict, i: int) -> Any:
        response = dcp.async_save(
            state, storage_writer=S3StorageWriter(_uri("dcp-process", i), **_endpoint()),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )  # fmt: skip
        return getattr(response, "upload_completion", response)

    return save


def fs_shm_thread() -> Callable[[dict, int], Any]:
    """DCP's ``FileSystemWriter`` into /dev/shm; each save replaces the one before, and the
    folder goes when the case ends (it is memory)."""
    from torch.distributed.checkpoint import FileSystemWriter

    root = tempfile.mkdtemp(prefix="s3ckpt-loop-", dir="/dev/shm")
    atexit.register(shutil.rmtree, root, ignore_errors=True)

    def writer(i: int) -> Any:
        shutil.rmtree(f"{root}/{i - 1}", ignore_errors=True)
        return FileSystemWriter(f"{root}/{i}")

    return dcp_thread(writer)


def s3torch_thread() -> Callable[[dict, int], Any]:
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageWriter

    config = S3ClientConfig(force_path_style=True)
    return dcp_thread(
        lambda i: S3StorageWriter("us-east-1", _uri("s3torch", i), s3client_config=config)
    )


MODES: dict[str, Callable[[], Callable[[dict, int], Any]]] = {
    "manager_default": manager("process"),
    "manager_thread": manager("thread"),
    "checkpoint_process": checkpoint_process,
    "dcp_thread": s3ckpt_dcp_thread,
    "dcp_process": s3ckpt_dcp_process,
    "fs_shm_thread": fs_shm_thread,
    "s3torch_thread": s3torch_thread,
    # what a thread-mode save costs with less Python than any store client (loop_floors)
    "floor_no_network": floor(ViewingWriter),
    "floor_raw_sockets": floor(RawSocketWriter),
    "floor_native_batch": floor(NativeBatchWriter),
    # what any uploader in its own process costs the loop on this host (loop_floors)
    "floor_process": lambda: ProcessFloor().save,
}


class _Waiter:
    """A save in flight seen as a future: ``done()`` and ``result()``."""

    def __init__(self, done: Callable[[], bool], wait: Callable[[], Any]) -> None:
        self.done, self.result = done, wait


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- timing ------------------------------------------------------------------------------


def _place_loop(pinned: bool, on_loop_core: bool) -> None:
    """Put this thread on the loop's core, or back with everything else."""
    if pinned:
        os.sched_setaffinity(0, LOOP_CPU if on_loop_core else OTHERS_CPU)


@dataclass(frozen=True)
class Stepped:
    """A stretch of steps: how many, their wall and the loop thread's CPU time, and how
    often the thread slept (voluntary context switches)."""

    count: int
    wall_s: float
    cpu_s: float
    sleeps: int

    @property
    def step_s(self) -> float:
        return self.wall_s / max(self.count, 1)

    @property
    def step_cpu_s(self) -> float:
        return self.cpu_s / max(self.count, 1)


def _sleeps_so_far() -> int:
    """This thread's voluntary context switches (Linux: ``RUSAGE_THREAD``)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


def _steps(step: Callable[[], None], until: Callable[[], bool]) -> Stepped:
    count, sleeps = 0, _sleeps_so_far()
    cpu, started = time.thread_time(), time.perf_counter()
    while not until():
        step()
        count += 1
    wall, cpu = time.perf_counter() - started, time.thread_time() - cpu
    return Stepped(count, wall, cpu, _sleeps_so_far() - sleeps)


def _collections() -> list[int]:
    """This interpreter's garbage collections so far, per generation: the young ones, and
    the full ones that hold the GIL for the whole heap (about 0.1 s here) wherever the
    save's allocations set them off."""
    return [generation["collections"] for generation in gc.get_stats()]


def _alone(step: Callable[[], None]) -> Stepped:
    deadline = time.perf_counter() + ALONE_S
    return _steps(step, lambda: time.perf_counter() >= deadline)


def shaped(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``state`` in the shape ``BENCH_STATE`` names (:data:`STATE_SHAPES`, nested by default)."""
    nested = os.environ.get("BENCH_STATE", STATE_SHAPES[0]) == STATE_SHAPES[0]
    return {"model": state} if nested else state


def run(loop: str, mode: str, placement: str, size_mib: int, reps: int) -> dict[str, Any]:
    pinned = placement == "pinned"
    torch.set_num_threads(1)
    _place_loop(pinned, on_loop_core=False)  # what starts from here inherits the other core
    step = LOOPS[loop]()
    state = make_state(size_mib)
    gib = state_nbytes(state) / GiB
    saved = shaped(state)
    floor = BareCopy(state)
    result: dict[str, Any] = {"loop": loop, "mode": mode, "placement": placement, "gib": gib,
                              "copy_s": statistics.median(floor.time() for _ in range(3))}  # fmt: skip
    if mode == "alone":
        _place_loop(pinned, on_loop_core=True)
        alone = _alone(step)
        result["step_alone_us"] = alone.step_s * 1e6
        result["step_cpu_alone_us"] = alone.step_cpu_s * 1e6
        return result
    save = MODES[mode]()
    save(saved, 0).result()  # warm-up: processes started, memory allocated
    samples = []
    for i in range(1, reps + 1):
        _place_loop(pinned, on_loop_core=True)
        before = _alone(step)
        _place_loop(pinned, on_loop_core=False)
        copy = floor.time()  # on the save's core, just before it
        collected_before = _collections()
        started = time.perf_counter()
        upload = save(saved, i)
        blocked = time.perf_counter() - started
        _place_loop(pinned, on_loop_core=True)
        during = _steps(step, upload.done)
        collections = [
            now - then for now, then in zip(_collections(), collected_before, strict=True)
        ]
        _place_loop(pinned, on_loop_core=False)
        upload.result()
        _place_loop(pinned, on_loop_core=True)
        after = _alone(step)
        _place_loop(pinned, on_loop_core=False)
        samples.append({**_rep(before, during, after, blocked, copy, gib),
                        "collections": collections})  # fmt: skip
    result["reps"] = samples
    return result


def _rep(
    before: Stepped, during: Stepped, after: Stepped, blocked: float, copy: float, gib: float
) -> dict[str, Any]:
    """One rep's measures (the module's docstring says what each means); ``copy``, the
    bare copy timed just before the save, what its times over the copy are over."""
    alone = (before.step_s + after.step_s) / 2
    cpu_alone = (before.step_cpu_s + after.step_cpu_s) / 2
    lost = blocked + during.wall_s * max(0.0, 1 - alone / during.step_s)
    # an upload done before the loop's first step leaves no CPU time to divide by
    waiting = during.wall_s / during.cpu_s - 1 if during.cpu_s > 0 else 0.0
    off_core = during.wall_s * waiting / (1 + waiting)  # the upload's time off the core
    return {
        "blocked_s": blocked, "upload_s": during.wall_s, "step_alone_us": alone * 1e6,
        "step_during_us": during.step_s * 1e6, "slowdown": during.step_s / alone - 1,
        "lost_s_per_gib": lost / gib, "step_cpu_alone_us": cpu_alone * 1e6,
        "step_cpu_during_us": during.step_cpu_s * 1e6,
        "waiting": waiting, "lost_waiting_s_per_gib": (blocked + off_core) / gib,
        "cpu_growth": during.step_cpu_s / cpu_alone - 1, "sleeps": during.sleeps,
        "alone_drift": after.step_s / before.step_s - 1, "copy_s": copy,
        "lost_over_copy": lost / copy, "lost_waiting_over_copy": (blocked + off_core) / copy,
        "blocked_over_copy": blocked / copy,
    }  # fmt: skip


if __name__ == "__main__":
    loop_name, mode_name, where = sys.argv[1:4]
    size = int(os.environ.get("BENCH_SIZE_MIB", "1024"))
    count = int(os.environ.get("BENCH_REPS", "2"))
    print(json.dumps(run(loop_name, mode_name, where, size, count)), flush=True)
    if mode_name == "dcp_process":
        os._exit(0)  # DCP's own background process would print a traceback at exit
