"""One benchmark case per process: ``python -m benchmarks.cases CASE`` prints a JSON result.

A fresh process per case gives each its own CPU-time and peak-RSS accounting (client CPU
only: the S3 server is another process). The environment carries the endpoint and the
credentials (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``...), plus ``BENCH_BUCKET``,
``BENCH_PREFIX``, ``BENCH_SIZE_MIB``, ``BENCH_REPS``, ``BENCH_TMP`` and ``BENCH_ROUND``
(cases run more than once take turns with their pair; round r's loads read round r's
saves). Cases ending in ``_https`` talk to the same server over TLS:
``BENCH_HTTPS_ENDPOINT`` and the CA that signed its certificate, ``BENCH_CA_FILE``. A case
that cannot run here (``gpu_staging`` and ``gpu_load`` without CUDA) prints ``{"case", "skipped"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from benchmarks.data import empty_like_state, make_state, state_nbytes

MiB = 1024 * 1024
PART = 16 * MiB
CONCURRENCY = 16
PEER_THREADS = 8

warnings.filterwarnings("ignore")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _reset_peak_rss() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class Env:
    def __init__(self) -> None:
        self.bucket = os.environ["BENCH_BUCKET"]
        self.prefix = os.environ["BENCH_PREFIX"]
        self.size_mib = int(os.environ["BENCH_SIZE_MIB"])
        self.reps = int(os.environ["BENCH_REPS"])
        self.tmp = Path(os.environ["BENCH_TMP"])
        self.endpoint = os.environ["AWS_ENDPOINT_URL"]
        self.round = int(os.environ.get("BENCH_ROUND", "0"))
        self.https_endpoint = os.environ.get("BENCH_HTTPS_ENDPOINT", "")
        self.ca_file = os.environ.get("BENCH_CA_FILE", "")

    def uri(self, system: str, rep: int) -> str:
        return f"s3://{self.bucket}/{self.prefix}/{system}/round{self.round}/rep{rep}"


def _s3ckpt_options(env: Env, *, https: bool = False) -> dict[str, Any]:
    if https:
        return {"endpoint_url": env.https_endpoint, "verify": env.ca_file}
    return {"endpoint_url": env.endpoint}


def _open_s3ckpt_client(env: Env, *, https: bool = False) -> None:
    """Create s3ckpt's client before timing, as the raw ceilings create theirs: a process
    pays for it once (botocore loads its S3 model), not once per checkpoint."""
    from s3ckpt.config import make_config
    from s3ckpt.s3.loop import io_loop
    from s3ckpt.s3.store import ObjectStore

    store = ObjectStore(make_config(None, **_s3ckpt_options(env, https=https)), env.bucket)
    io_loop().run(store.head_bucket())


# -- the cases: each returns a per-rep callable (and may keep state between reps) --------


def memcpy(env: Env, state: dict) -> Callable[[int], dict]:
    buffers = empty_like_state(state)

    def rep(_: int) -> dict:
        for key, tensor in state.items():
            buffers[key].copy_(tensor)
        return {}

    return rep


def _save_case(
    system: str, https: bool, **extra: Any
) -> Callable[[Env, dict], Callable[[int], dict]]:
    def case(env: Env, state: dict) -> Callable[[int], dict]:
        from s3ckpt import S3StorageWriter

        def rep(i: int) -> dict:
            options = {**_s3ckpt_options(env, https=https), **extra}
            dcp.save(state, storage_writer=S3StorageWriter(env.uri(system, i), **options))
            return {}

        return rep

    return case


def _load_case(system: str, https: bool) -> Callable[[Env, dict], Callable[[int], dict]]:
    def case(env: Env, state: dict) -> Callable[[int], dict]:
        from s3ckpt import S3StorageReader

        target = empty_like_state(state)

        def rep(i: int) -> dict:
            options = _s3ckpt_options(env, https=https)
            dcp.load(target, storage_reader=S3StorageReader(env.uri(system, i), **options))
            return {}

        return rep

    return case


s3ckpt_save, s3ckpt_load = _save_case("s3ckpt", False), _load_case("s3ckpt", False)
s3ckpt_save_https = _save_case("s3ckpt-https", True)
s3ckpt_load_https = _load_case("s3ckpt-https", True)
# The same save with upload bodies left to aiohttp and the event loop's TLS: what the
# data plane's blocking TLS sockets (s3ckpt.s3.wire) are measured against.
s3ckpt_save_https_aiohttp = _save_case("s3ckpt-https-aiohttp", True, direct_uploads=False)


def s3ckpt_async(env: Env, state: dict) -> Callable[[int], dict]:
    from s3ckpt import HostStager, S3StorageWriter

    stager = HostStager()  # reused: its buffers are kept from save to save

    def rep(i: int) -> dict:
        started = time.perf_counter()
        future = dcp.async_save(
            state,
            storage_writer=S3StorageWriter(env.uri("s3ckpt-async", i), **_s3ckpt_options(env)),
            async_stager=stager,
        )
        blocked = time.perf_counter() - started
        (future.upload_completion if hasattr(future, "upload_completion") else future).result()
        return {"blocked": blocked}

    return rep


def _compressed_cases(name: str, compression: str | None) -> tuple[Callable, Callable]:
    """Save and load cases on real weights (MiniLM-L6, bf16), with or without compression."""
    from s3ckpt import S3StorageReader, S3StorageWriter

    def save(env: Env, state: dict) -> Callable[[int], dict]:
        def rep(i: int) -> dict:
            writer = S3StorageWriter(
                env.uri(name, i), compression=compression, **_s3ckpt_options(env)
            )
            dcp.save(state, storage_writer=writer)
            return {}

        return rep

    def load(env: Env, state: dict) -> Callable[[int], dict]:
        target = empty_like_state(state)

        def rep(i: int) -> dict:
            dcp.load(
                target, storage_reader=S3StorageReader(env.uri(name, i), **_s3ckpt_options(env))
            )
            return {}

        return rep

    return save, load


s3ckpt_save_real, s3ckpt_load_real = _compressed_cases("real", None)
s3ckpt_save_zstd, s3ckpt_load_zstd = _compressed_cases("zstd", "zstd")
REAL_WEIGHT_CASES = {"s3ckpt_save_real", "s3ckpt_load_real", "s3ckpt_save_zstd", "s3ckpt_load_zstd"}


def _s3torch_config() -> Any:
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(force_path_style=True)


def s3torch_save(env: Env, state: dict) -> Callable[[int], dict]:
    from s3torchconnector.dcp import S3StorageWriter

    def rep(i: int) -> dict:
        writer = S3StorageWriter(
            "us-east-1",
            env.uri("s3torch", i),
            s3client_config=_s3torch_config(),
            thread_count=PEER_THREADS,
        )
        dcp.save(state, storage_writer=writer)
        return {}

    return rep


def s3torch_load(env: Env, state: dict) -> Callable[[int], dict]:
    from s3torchconnector.dcp import S3StorageReader

    target = empty_like_state(state)

    def rep(i: int) -> dict:
        dcp.load(
            target,
            storage_reader=S3StorageReader(
                "us-east-1", env.uri("s3torch", i), s3client_config=_s3torch_config()
            ),
        )
        return {}

    return rep


def _fsspec_kwargs(env: Env) -> dict[str, Any]:
    return {
        "endpoint_url": env.endpoint,
        "key": os.environ["AWS_ACCESS_KEY_ID"],
        "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
    }


def fsspec_save(env: Env, state: dict) -> Callable[[int], dict]:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    def rep(i: int) -> dict:
        writer = FsspecWriter(
            env.uri("fsspec", i), thread_count=PEER_THREADS, overwrite=True, **_fsspec_kwargs(env)
        )
        dcp.save(state, storage_writer=writer)
        return {}

    return rep


def fsspec_load(env: Env, state: dict) -> Callable[[int], dict]:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    target = empty_like_state(state)

    def rep(i: int) -> dict:
        dcp.load(target, storage_reader=FsspecReader(env.uri("fsspec", i), **_fsspec_kwargs(env)))
        return {}

    return rep


def filesystem_save(env: Env, state: dict) -> Callable[[int], dict]:
    def rep(i: int) -> dict:
        writer = dcp.FileSystemWriter(
            str(env.tmp / f"fs-rep{i}"), thread_count=PEER_THREADS, overwrite=True
        )
        dcp.save(state, storage_writer=writer)
        return {}

    return rep


def filesystem_load(env: Env, state: dict) -> Callable[[int], dict]:
    target = empty_like_state(state)

    def rep(i: int) -> dict:
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(env.tmp / f"fs-rep{i}")))
        return {}

    return rep


def _raw_client(env: Env, https: bool, *, uvloop: bool) -> Any:
    from benchmarks.raw import RawClient

    if https:
        return RawClient(env.https_endpoint, CONCURRENCY, uvloop=uvloop, verify=env.ca_file)
    return RawClient(env.endpoint, CONCURRENCY, uvloop=uvloop)


def _raw_upload_case(system: str, https: bool) -> Callable[[Env, dict], Callable[[int], dict]]:
    """The ceiling: one multipart upload of the same bytes, zero-copy bodies, no extras."""

    def case(env: Env, state: dict) -> Callable[[int], dict]:
        from benchmarks.raw import concat_bytes

        payload = concat_bytes(state)
        client = _raw_client(env, https, uvloop=True)  # uvloop: the faster loop for writes

        def rep(i: int) -> dict:
            client.upload(env.bucket, f"{env.prefix}/{system}/rep{i}", payload, PART)
            return {}

        return rep

    return case


def _raw_download_case(system: str, https: bool) -> Callable[[Env, dict], Callable[[int], dict]]:
    """The ceiling: parallel ranged GETs of the uploaded object into one preallocated buffer."""

    def case(env: Env, state: dict) -> Callable[[int], dict]:
        size = state_nbytes(state)
        buffer = torch.zeros(size, dtype=torch.uint8)
        client = _raw_client(env, https, uvloop=False)

        def rep(i: int) -> dict:
            client.download(env.bucket, f"{env.prefix}/{system}/rep{i}", buffer, PART)
            return {}

        return rep

    return case


raw_upload, raw_download = _raw_upload_case("raw", False), _raw_download_case("raw", False)
raw_upload_https = _raw_upload_case("raw-https", True)
raw_download_https = _raw_download_case("raw-https", True)


def _curl_download_case(system: str, https: bool) -> Callable[[Env, dict], Callable[[int], dict]]:
    """A C client for scale: curl (libcurl, the system OpenSSL) GETs the same bytes as one
    object to /dev/null. What TLS costs a client that adds nothing in Python, and how far
    the server's share of the two cores lets any client go over HTTPS."""

    def case(env: Env, state: dict) -> Callable[[int], dict]:
        import boto3

        from benchmarks.raw import concat_bytes

        curl = shutil.which("curl") or "curl"  # run() skips the case without one
        options = {"endpoint_url": env.https_endpoint, "verify": env.ca_file} if https else {}
        client = boto3.client("s3", **(options or {"endpoint_url": env.endpoint}))
        key = f"{env.prefix}/{system}/object"
        client.put_object(Bucket=env.bucket, Key=key, Body=bytes(concat_bytes(state)))
        url = client.generate_presigned_url(
            "get_object", Params={"Bucket": env.bucket, "Key": key}, ExpiresIn=3600
        )
        command = [curl, "-sS", "--fail", "-o", "/dev/null", url]
        if https:
            command[1:1] = ["--cacert", env.ca_file]

        def rep(i: int) -> dict:
            own, children = _cpu(), _children_cpu()
            subprocess.run(command, check=True)
            return {"cpu": _cpu() - own + _children_cpu() - children}

        return rep

    return case


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


curl_download = _curl_download_case("curl", False)
curl_download_https = _curl_download_case("curl-https", True)
HTTPS_CASES = {"raw_upload_https", "raw_download_https", "s3ckpt_save_https",
               "s3ckpt_load_https", "s3ckpt_save_https_aiohttp",
               "curl_download_https"}  # fmt: skip


def gpu_staging(env: Env, state: dict) -> Callable[[int], dict]:
    """Training stall of async saves from CUDA tensors against a bare D2H copy (``benchmarks.gpu``)."""
    from benchmarks.gpu import gpu_staging_case

    return gpu_staging_case(state, env.uri, _s3ckpt_options(env))


def gpu_load(env: Env, state: dict) -> Callable[[int], dict]:
    """A load into CUDA tensors against the network read plus a bare H2D copy (``benchmarks.gpu``)."""
    from benchmarks.gpu import gpu_load_case

    return gpu_load_case(state, env.uri, _s3ckpt_options(env))


def _commit_case(conditional: bool) -> Callable[[Env, dict], Callable[[int], dict]]:
    """Small saves, timing the commit (``finish``: metadata object, the check that every
    object is there, the manifest) with ``If-None-Match`` or with the claim protocol."""

    def case(env: Env, state: dict) -> Callable[[int], dict]:
        from s3ckpt import S3StorageWriter

        system = "commit-conditional" if conditional else "commit-claims"

        def rep(i: int) -> dict:
            writer = S3StorageWriter(
                env.uri(system, i), conditional_commit=conditional, **_s3ckpt_options(env)
            )
            finish, timed = writer.finish, {}

            def timed_finish(metadata: Any, results: Any) -> None:
                started = time.perf_counter()
                finish(metadata, results)
                timed["commit"] = time.perf_counter() - started

            writer.finish = timed_finish  # type: ignore[method-assign]
            dcp.save(state, storage_writer=writer)
            return timed

        return rep

    return case


commit_conditional = _commit_case(conditional=True)
commit_claims = _commit_case(conditional=False)
COMMIT_CASES = {"commit_conditional", "commit_claims"}
COMMIT_STATE_MIB = 1  # commit latency does not depend on the bytes saved before it
COMMIT_REPS = 15


CASES: dict[str, Callable[[Env, dict], Callable[[int], dict]]] = {
    f.__name__: f
    for f in (
        memcpy, s3ckpt_async, s3torch_save, s3torch_load, fsspec_save, fsspec_load,
        filesystem_save, filesystem_load, gpu_staging, gpu_load,
    )
} | {
    "raw_upload": raw_upload, "raw_download": raw_download,
    "s3ckpt_save": s3ckpt_save, "s3ckpt_load": s3ckpt_load,
    "raw_upload_https": raw_upload_https, "raw_download_https": raw_download_https,
    "curl_download": curl_download, "curl_download_https": curl_download_https,
    "s3ckpt_save_https": s3ckpt_save_https, "s3ckpt_load_https": s3ckpt_load_https,
    "s3ckpt_save_https_aiohttp": s3ckpt_save_https_aiohttp,
    "s3ckpt_save_real": s3ckpt_save_real, "s3ckpt_load_real": s3ckpt_load_real,
    "s3ckpt_save_zstd": s3ckpt_save_zstd, "s3ckpt_load_zstd": s3ckpt_load_zstd,
    "commit_conditional": commit_conditional, "commit_claims": commit_claims,
}  # fmt: skip


def run(case: str) -> dict[str, Any]:
    env = Env()
    if case in ("gpu_staging", "gpu_load"):
        from benchmarks.gpu import cuda_skip_reason

        reason = cuda_skip_reason()
        if reason is not None:
            return {"case": case, "skipped": reason}
    if case.startswith("curl") and shutil.which("curl") is None:
        return {"case": case, "skipped": "curl not found"}
    if case in HTTPS_CASES and not env.https_endpoint:
        return {"case": case, "skipped": "no HTTPS endpoint (BENCH_HTTPS_ENDPOINT)"}
    if case in REAL_WEIGHT_CASES:
        from benchmarks.weights import real_state

        state = real_state(env.size_mib)
    elif case in COMMIT_CASES:
        state = make_state(COMMIT_STATE_MIB)
    else:
        state = make_state(env.size_mib)
    rep = CASES[case](env, state)
    if case.startswith(("s3ckpt", "commit", "gpu")):
        _open_s3ckpt_client(env, https=case in HTTPS_CASES)
    _reset_peak_rss()
    baseline = _rss_kib("VmRSS")
    samples = []
    for i in range(COMMIT_REPS if case in COMMIT_CASES else env.reps):
        cpu, started = _cpu(), time.perf_counter()
        extra = rep(i)
        samples.append({"wall": time.perf_counter() - started, "cpu": _cpu() - cpu, **extra})
    return {
        "case": case,
        "bytes": state_nbytes(state),
        "samples": samples,
        "rss_baseline_mib": baseline / 1024,
        "rss_peak_mib": _rss_kib("VmHWM") / 1024,
    }


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    print(json.dumps(run(sys.argv[1])))
