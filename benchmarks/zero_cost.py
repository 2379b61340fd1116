"""``make bench-dataplane``: s3ckpt and its peers on the zero-cost S3 server, side by side.

On a real server sharing the machine's two cores, the server takes most of the CPU and
the clients' differences drown in it. Here the server (:mod:`benchmarks.zero_server`)
costs a small fraction of a CPU-second per GiB, so throughput and CPU per GiB are the
clients' own. In one run, each case in its own process (:mod:`benchmarks.dataplane_cases`):
the same bytes on a bare socket (the kernel's share, which no client avoids), s3ckpt
``dcp.save``/``dcp.load``, raw aiobotocore (the ceilings), s3torchconnector's DCP
writer and reader, s5cmd and boto3's s3transfer moving the same bytes up and down; then
every pair again with two processes at once; then the slowdown of a CPU-bound Python
loop while a thread-mode ``dcp.async_save`` runs beside it. The server's own CPU is read
from /proc around every case. Output: a table on the terminal and
``benchmarks/results/dataplane.json``.

    python -m benchmarks.zero_cost [--size-mib 1024] [--reps 2] [--cases ...] [--no-parallel]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.tls import aes_gcm_report
from benchmarks.zero_server import ZeroS3

GiB = 1024**3
RESULTS = Path(__file__).resolve().parent / "results"
# (label, save/upload case, load/download case): a load reads what its save wrote.
PAIRS = [
    ("Python socket, no HTTP library (floor)", "socket_upload", "socket_download"),
    ("raw aiobotocore (ceiling)", "raw_upload", "raw_download"),
    ("s3ckpt", "s3ckpt_save", "s3ckpt_load"),
    ("s3ckpt over HTTPS", "s3ckpt_save_https", "s3ckpt_load_https"),
    ("s3torchconnector", "s3torch_save", "s3torch_load"),
    ("s5cmd", "s5cmd_upload", "s5cmd_download"),
    ("boto3 s3transfer", "s3transfer_upload", "s3transfer_download"),
    ("s3dlio", "s3dlio_save", "s3dlio_load"),
]
LOOP = "train_loop"
LOOP_PARTS = ["train_loop_python", "train_loop_torch"]  # on demand: --cases
SINGLE_ONLY = {"s3ckpt_save_https", "s3ckpt_load_https"}  # not run as 2 processes
ALL = [c for _, up, down in PAIRS for c in (up, down)] + [LOOP]
KNOWN = [*ALL, *LOOP_PARTS]
# The targets (docs/performance.md): (name, kind, operands, goal).
SAVE_CPU_MAX, LOAD_CPU_MAX, LOOP_SLOWDOWN_MAX, SERVER_CPU_MAX = 0.35, 0.30, 0.10, 0.2
TLS_OVER_AES_MAX = 1.5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=2, help="runs per case process (default 2)")
    parser.add_argument("--cases", default=",".join(ALL), help="subset of: " + ", ".join(KNOWN))
    parser.add_argument("--no-parallel", action="store_true", help="skip the 2-process runs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    chosen = set(args.cases.split(","))
    if not chosen <= set(KNOWN) or args.reps < 1 or args.size_mib < 1:
        parser.error("unknown case, or reps/size below 1")
    report = measure(args.size_mib, args.reps, chosen, parallel=not args.no_parallel)
    print(table(report))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dataplane.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out / 'dataplane.json'}", file=sys.stderr)
    return 0


def measure(size_mib: int, reps: int, chosen: set[str], *, parallel: bool) -> dict[str, Any]:
    """Every chosen case once (``reps`` runs in its process), then the pairs with two
    processes at once, then the loop; the report of :func:`summarize`."""
    pool = min(3 * size_mib * reps + 256, 6144)  # the objects one pair holds at a time
    files = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    runs: dict[str, Any] = {}
    twin: dict[str, Any] = {}
    tls = bool(chosen & SINGLE_ONLY) and tls_available()
    with (
        ZeroS3(pool_mib=pool, tls=tls) as server,
        tempfile.TemporaryDirectory(prefix="s3ckpt-dataplane-") as tmp,
        tempfile.TemporaryDirectory(prefix="s3ckpt-dataplane-", dir=files) as shm,
    ):
        env = {**os.environ, **server.env(), "BENCH_BUCKET": server.bucket,
               "BENCH_SIZE_MIB": str(size_mib), "BENCH_TMP": tmp, "BENCH_FILES": shm}  # fmt: skip
        if tls:
            env |= {
                "BENCH_HTTPS_ENDPOINT": server.https_endpoint_url,
                "BENCH_CA_FILE": server.ca_file,
            }
        prefix = f"dataplane-{int(time.time())}"
        for _, up, down in PAIRS:
            for case in (c for c in (up, down) if c in chosen):
                runs[case] = _timed(server, [case], env, prefix, reps)[0]
            _delete_prefix(server, prefix + "/")
        if parallel:
            for _, up, down in PAIRS:
                for case in (c for c in (up, down) if c in chosen - SINGLE_ONLY):
                    twin[case] = _timed(server, [case, case], env, prefix, 1)
                _delete_prefix(server, prefix)
        for loop in (c for c in (LOOP, *LOOP_PARTS) if c in chosen):
            runs[loop] = _timed(server, [loop], env, prefix, reps)[0]
            _delete_prefix(server, prefix)
        idle = _idle_cost(server)
        aes = aes_gcm_report(server.https_endpoint_url, server.ca_file) if tls else None
    report = summarize(runs, twin, size_mib=size_mib, reps=reps, server_idle_cpu_s=idle)
    if aes is not None:
        report["tls"] = tls_summary(report, aes)
    report["targets"] = targets(report)
    return report


def tls_available() -> bool:
    """Whether the server binary speaks HTTPS (built against OpenSSL)."""
    try:
        with ZeroS3(tls=True):
            return True
    except RuntimeError:
        return False


def tls_summary(report: dict[str, Any], aes: dict[str, Any]) -> dict[str, Any]:
    """What HTTPS adds to s3ckpt's client CPU per GiB over HTTP, against the AES-GCM cost of
    the same bytes (the negotiated cipher's key size, ``openssl speed``, same OpenSSL)."""
    bits = 256 if "AES_256" in aes.get("negotiated_cipher", "") else 128
    floor = aes.get(f"openssl_aes{bits}_cpu_s_per_gib") or aes.get("cryptography_cpu_s_per_gib")
    summary: dict[str, Any] = {"aes_gcm": aes, "aes_cpu_s_per_gib": floor, "aes_bits": bits}
    for op, plain, secure in (("save", "s3ckpt_save", "s3ckpt_save_https"),
                              ("load", "s3ckpt_load", "s3ckpt_load_https")):  # fmt: skip
        a, b = (
            _field(report, plain, "cpu_s_per_gib_best"),
            _field(report, secure, "cpu_s_per_gib_best"),
        )
        if a is not None and b is not None and floor:
            summary[op] = {"added_cpu_s_per_gib": b - a, "over_aes": (b - a) / floor}
    return summary


def _timed(
    server: ZeroS3, cases: list[str], env: dict[str, str], prefix: str, reps: int
) -> list[dict[str, Any]]:
    """Run ``cases`` as processes started together; each result gets the server's CPU
    over the whole batch."""
    print(f"running {' + '.join(cases)} ({reps} x {env['BENCH_SIZE_MIB']} MiB) ...",
          file=sys.stderr, flush=True)  # fmt: skip
    before = server.cpu_seconds()
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.dataplane_cases", case],
            env={**env, "BENCH_PREFIX": f"{prefix}/p{index}", "BENCH_REPS": str(reps)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index, case in enumerate(cases)
    ]
    results = []
    for case, process in zip(cases, processes, strict=True):
        out, err = process.communicate(timeout=1800)
        if process.returncode != 0:
            tail = "\n".join(err.strip().splitlines()[-15:])
            print(f"  {case} failed:\n{tail}", file=sys.stderr)
            results.append({"case": case, "error": tail})
        else:
            results.append(json.loads(out.strip().splitlines()[-1]))
    server_cpu = server.cpu_seconds() - before
    for result in results:
        result["server_cpu_s"] = server_cpu
    return results


def _idle_cost(server: ZeroS3) -> float:
    """The server's CPU over one idle second: what the per-case figures include anyway."""
    before = server.cpu_seconds()
    time.sleep(1.0)
    return server.cpu_seconds() - before


def _delete_prefix(server: ZeroS3, prefix: str) -> None:
    client = server.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=server.bucket, Prefix=prefix)
    for page in pages:
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=server.bucket, Delete={"Objects": keys, "Quiet": True})


# -- the summary ---------------------------------------------------------------------------


def _single(result: dict[str, Any]) -> dict[str, Any]:
    if "samples" not in result:
        return {k: v for k, v in result.items() if k in ("skipped", "error")}
    nbytes, samples = result["bytes"], result["samples"]
    rates = [nbytes / s["wall"] / 1e6 for s in samples]
    cpus = [s["cpu"] / (nbytes / GiB) for s in samples]
    return {
        "mbps_best": max(rates),
        "mbps_all": rates,
        "cpu_s_per_gib_best": min(cpus),
        "cpu_s_per_gib_all": cpus,
        "server_cpu_s_per_gib": result["server_cpu_s"] / (nbytes * len(samples) / GiB),
        "bytes": nbytes,
    }


def _pair(results: list[dict[str, Any]]) -> dict[str, Any]:
    if any("samples" not in r for r in results):
        return {
            "error": next(r.get("error") or r.get("skipped") for r in results if "samples" not in r)
        }
    nbytes = sum(r["bytes"] for r in results)
    start = min(s["start"] for r in results for s in r["samples"])
    end = max(s["end"] for r in results for s in r["samples"])
    cpu = sum(s["cpu"] for r in results for s in r["samples"])
    return {
        "mbps_total": nbytes / (end - start) / 1e6,
        "cpu_s_per_gib": cpu / (nbytes / GiB),
        "server_cpu_s_per_gib": results[0]["server_cpu_s"] / (nbytes / GiB),
    }


def _loop(result: dict[str, Any]) -> dict[str, Any]:
    if "samples" not in result:
        return {k: v for k, v in result.items() if k in ("skipped", "error")}
    samples = result["samples"]
    keep = (
        "slowdown",
        "step_alone_us",
        "step_during_us",
        "upload_s",
        "blocked",
        "loop_on_cpu",
        "save_threads_cpu_s",
    )
    return {
        "slowdown_best": min(s["slowdown"] for s in samples),
        "runs": [{k: s[k] for k in keep} for s in samples],
    }


def summarize(
    runs: dict[str, Any],
    twin: dict[str, Any],
    *,
    size_mib: int,
    reps: int,
    server_idle_cpu_s: float,
) -> dict[str, Any]:
    loops = (LOOP, *LOOP_PARTS)
    cases = {c: _single(r) for c, r in runs.items() if c not in loops}
    report: dict[str, Any] = {
        "size_mib": size_mib,
        "reps": reps,
        "server_idle_cpu_s_per_s": server_idle_cpu_s,
        "cases": cases,
        "two_processes": {c: _pair(r) for c, r in twin.items()},
    }
    for loop in (c for c in loops if c in runs):
        report[loop] = _loop(runs[loop])
    return report


def _field(report: dict[str, Any], case: str, field: str) -> float | None:
    value = report["cases"].get(case, {}).get(field)
    return value if isinstance(value, int | float) else None


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with its measured value (a ratio, CPU-s/GiB or a fraction) and whether met."""

    def ratio(a: str, b: str, goal: float) -> tuple[float | None, str, float]:
        x, y = _field(report, a, "mbps_best"), _field(report, b, "mbps_best")
        return (x / y if x and y else None), ">=", goal

    def bound(case: str, goal: float) -> tuple[float | None, str, float]:
        return _field(report, case, "cpu_s_per_gib_best"), "<=", goal

    loop = report.get("train_loop", {}).get("slowdown_best")
    server = [v["server_cpu_s_per_gib"] for c, v in report["cases"].items()
              if "server_cpu_s_per_gib" in v and not c.endswith("_https")]  # fmt: skip
    checks = {
        "save MB/s / s5cmd upload": ratio("s3ckpt_save", "s5cmd_upload", 1.0),
        "save MB/s / s3torchconnector": ratio("s3ckpt_save", "s3torch_save", 2.0),
        "load MB/s / s5cmd download": ratio("s3ckpt_load", "s5cmd_download", 1.0),
        "load MB/s / s3torchconnector": ratio("s3ckpt_load", "s3torch_load", 2.0),
        "save MB/s / s3dlio (bytes only)": ratio("s3ckpt_save", "s3dlio_save", 1.0),
        "load MB/s / s3dlio (bytes only)": ratio("s3ckpt_load", "s3dlio_load", 1.0),
        "save client CPU-s/GiB": bound("s3ckpt_save", SAVE_CPU_MAX),
        "load client CPU-s/GiB": bound("s3ckpt_load", LOAD_CPU_MAX),
        "training loop slowdown, thread-mode async_save": (loop, "<=", LOOP_SLOWDOWN_MAX),
        "server CPU-s/GiB, worst HTTP case": (
            max(server) if server else None,
            "<=",
            SERVER_CPU_MAX,
        ),
    }
    tls = report.get("tls", {})
    for op in ("save", "load"):
        if op in tls:
            checks[f"HTTPS {op}: CPU added / AES-GCM cost"] = (
                tls[op]["over_aes"],
                "<=",
                TLS_OVER_AES_MAX,
            )
    rows = []
    for name, (value, op, goal) in checks.items():
        met = None if value is None else (value >= goal if op == ">=" else value <= goal)
        rows.append({"target": name, "value": value, "goal": f"{op} {goal:g}", "met": met})
    return rows


def table(report: dict[str, Any]) -> str:
    lines = [
        f"zero-cost S3 server, {report['size_mib']} MiB, best of {report['reps']} runs per process",
        "",
        f"{'case':<22}{'MB/s':>9}{'client CPU-s/GiB':>18}{'server CPU-s/GiB':>18}"
        f"{'2 procs MB/s':>14}{'2 procs CPU-s/GiB':>19}",
    ]
    for case in ALL[:-1]:
        if case not in report["cases"]:
            continue
        one, two = report["cases"][case], report["two_processes"].get(case, {})
        if "mbps_best" not in one:
            lines.append(f"{case:<22}  {one.get('skipped') or one.get('error', '')[-60:]}")
            continue
        pair = (
            f"{two['mbps_total']:>14.0f}{two['cpu_s_per_gib']:>19.2f}"
            if "mbps_total" in two
            else ""
        )
        lines.append(f"{case:<22}{one['mbps_best']:>9.0f}{one['cpu_s_per_gib_best']:>18.2f}"
                     f"{one['server_cpu_s_per_gib']:>18.3f}{pair}")  # fmt: skip
    for name in (LOOP, *LOOP_PARTS):
        loop = report.get(name)
        if not loop or "runs" not in loop:
            continue
        lines += ["", f"{name}: the loop beside a thread-mode dcp.async_save (per run):"]
        for run in loop["runs"]:
            lines.append(f"  step alone {run['step_alone_us']:.0f} us, during upload "
                             f"{run['step_during_us']:.0f} us: slowdown {run['slowdown'] * 100:+.1f} %"
                             f" (upload {run['upload_s']:.2f} s, blocked {run['blocked']:.2f} s; loop on a"
                             f" core {run['loop_on_cpu'] * 100:.0f} % of it, save threads"
                             f" {run['save_threads_cpu_s']:.2f} CPU-s)")  # fmt: skip
    tls = report.get("tls")
    if tls:
        lines += ["", f"HTTPS ({tls['aes_gcm'].get('negotiated_cipher', '?')}): AES-{tls['aes_bits']}-GCM "
                  f"costs {tls['aes_cpu_s_per_gib']:.3f} CPU-s/GiB ({tls['aes_gcm']['ssl_module_openssl']})"]  # fmt: skip
        for op in ("save", "load"):
            if op in tls:
                lines.append(f"  {op}: HTTPS adds {tls[op]['added_cpu_s_per_gib']:+.2f} CPU-s/GiB"
                             f" = {tls[op]['over_aes']:.2f}x the AES cost")  # fmt: skip
    lines += ["", f"{'target':<50}{'goal':>9}{'value':>9}  status"]
    for row in report["targets"]:
        value = "-" if row["value"] is None else f"{row['value']:.3g}"
        status = "not measured" if row["met"] is None else ("met" if row["met"] else "NOT met")
        lines.append(f"{row['target']:<50}{row['goal']:>9}{value:>9}  {status}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
