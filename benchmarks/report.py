"""Summaries, the ratio targets, the terminal table and the chart of a benchmark run."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.gpu import GPU_LOAD_TARGET, STAGING_TARGET, gpu_load_summary, staging_summary

GiB = 1024**3

# The systems compared, by operation: (case, label).
SAVES = [("raw_upload", "raw multipart upload (ceiling)"), ("s3ckpt_save", "s3ckpt dcp.save"),
         ("s3ckpt_async", "s3ckpt dcp.async_save"), ("s3torch_save", "s3torchconnector"),
         ("fsspec_save", "FsspecWriter + s3fs"), ("filesystem_save", "FileSystemWriter (local disk)")]  # fmt: skip
COMPRESSION = [("s3ckpt_save_real", "save, raw (MiniLM bf16)"), ("s3ckpt_save_zstd", "save, zstd (MiniLM bf16)"),
               ("s3ckpt_load_real", "load, raw (MiniLM bf16)"), ("s3ckpt_load_zstd", "load, zstd (MiniLM bf16)")]  # fmt: skip
# HTTPS against HTTP, same server, same run: (HTTP case, HTTPS case, label).
TLS_PAIRS = [("raw_upload", "raw_upload_https", "raw multipart upload"),
             ("s3ckpt_save", "s3ckpt_save_https", "s3ckpt dcp.save"),
             ("s3ckpt_save", "s3ckpt_save_https_aiohttp", "  same, bodies via aiohttp"),
             ("raw_download", "raw_download_https", "raw ranged GETs"),
             ("curl_download", "curl_download_https", "curl GET (C client)"),
             ("s3ckpt_load", "s3ckpt_load_https", "s3ckpt dcp.load")]  # fmt: skip
LOADS = [("raw_download", "raw ranged GETs (ceiling)"), ("s3ckpt_load", "s3ckpt dcp.load"),
         ("s3torch_load", "s3torchconnector"), ("fsspec_load", "FsspecReader + s3fs"),
         ("filesystem_load", "FileSystemReader (local disk)")]  # fmt: skip


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per case: throughput (median/min/max MB/s), CPU-s per GiB, peak RSS over baseline."""
    summary: dict[str, Any] = {}
    for case, result in results.items():
        if "skipped" in result:
            summary[case] = {"skipped": result["skipped"]}
            continue
        if "error" in result:
            summary[case] = {
                "error": result["error"].splitlines()[-1] if result["error"] else "failed"
            }
            continue
        nbytes = result["bytes"]
        walls = [s["wall"] for s in result["samples"]]
        rates = sorted(nbytes / w / 1e6 for w in walls)
        entry = {
            "mbps_median": statistics.median(rates),
            "mbps_min": rates[0],
            "mbps_max": rates[-1],
            "seconds_median": statistics.median(walls),
            "cpu_s_per_gib": statistics.median(s["cpu"] for s in result["samples"])
            / (nbytes / GiB),
            "rss_over_baseline_mib": result["rss_peak_mib"] - result["rss_baseline_mib"],
            "bytes": nbytes,
        }
        blocked = [s["blocked"] for s in result["samples"] if "blocked" in s]
        if blocked:
            entry["blocked_first_s"] = blocked[0]
            entry["blocked_median_after_first_s"] = statistics.median(blocked[1:] or blocked)
        if all("d2h" in s for s in result["samples"]):
            entry["staging"] = staging_summary(result["samples"])
        if all("gpu_load" in s for s in result["samples"]):
            entry["gpu_load"] = gpu_load_summary(result["samples"])
        commits = sorted(s["commit"] for s in result["samples"] if "commit" in s)
        if commits:
            entry["commit_median_s"] = statistics.median(commits)
            entry["commit_max_s"] = commits[-1]
        summary[case] = entry
    return summary


def _ratio(summary: dict[str, Any], a: str, b: str, field: str) -> float | None:
    if field not in summary.get(a, {}) or field not in summary.get(b, {}) or not summary[b][field]:
        return None
    return summary[a][field] / summary[b][field]


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target as (name, measured ratio, goal, met)."""
    staged_mib = summary.get("s3ckpt_save", {}).get("bytes", 0) / 2**20
    checks = [
        (
            "save throughput / raw upload",
            _ratio(summary, "s3ckpt_save", "raw_upload", "mbps_median"),
            ">=",
            0.95,
        ),
        (
            "save throughput / s3torchconnector",
            _ratio(summary, "s3ckpt_save", "s3torch_save", "mbps_median"),
            ">",
            1.0,
        ),
        (
            "load throughput / raw ranged GETs",
            _ratio(summary, "s3ckpt_load", "raw_download", "mbps_median"),
            ">=",
            0.85,
        ),
        (
            "load throughput / s3torchconnector",
            _ratio(summary, "s3ckpt_load", "s3torch_load", "mbps_median"),
            ">=",
            1.7,
        ),
        ("async_save blocked (2nd save on) / memcpy", _blocked_ratio(summary), "<=", 2.0),
        (
            "save CPU-s/GiB / raw upload",
            _ratio(summary, "s3ckpt_save", "raw_upload", "cpu_s_per_gib"),
            "<=",
            1.2,
        ),
        (
            "save CPU-s/GiB / s3torchconnector",
            _ratio(summary, "s3ckpt_save", "s3torch_save", "cpu_s_per_gib"),
            "<",
            1.0,
        ),
        (
            "load CPU-s/GiB / raw ranged GETs",
            _ratio(summary, "s3ckpt_load", "raw_download", "cpu_s_per_gib"),
            "<=",
            1.2,
        ),
        (
            "load CPU-s/GiB / s3torchconnector",
            _ratio(summary, "s3ckpt_load", "s3torch_load", "cpu_s_per_gib"),
            "<",
            1.0,
        ),
        ("save peak RSS over baseline / 512 MiB", _rss_ratio(summary, "s3ckpt_save", 0), "<=", 1.0),
        (
            "async_save peak RSS over baseline / (staged + 512 MiB)",
            _rss_ratio(summary, "s3ckpt_async", staged_mib),
            "<=",
            1.0,
        ),
        (
            "zstd save throughput / uncompressed (real weights)",
            _ratio(summary, "s3ckpt_save_zstd", "s3ckpt_save_real", "mbps_median"),
            ">=",
            1.0,
        ),
        (
            "zstd save peak RSS over uncompressed save's / 256 MiB",
            _rss_excess(summary, "s3ckpt_save_zstd", "s3ckpt_save_real", 256),
            "<=",
            1.0,
        ),
        (
            "zstd load throughput / uncompressed (real weights)",
            _ratio(summary, "s3ckpt_load_zstd", "s3ckpt_load_real", "mbps_median"),
            ">=",
            1.0,
        ),
    ]
    checks += _tls_checks(summary) + _staging_checks(summary)
    out = []
    for name, value, op, goal in checks:
        met = (
            None
            if value is None
            else {">=": value >= goal, ">": value > goal, "<=": value <= goal, "<": value < goal}[
                op
            ]
        )
        out.append({"target": name, "ratio": value, "goal": f"{op} {goal}", "met": met})
    return out


def _tls_checks(summary: dict[str, Any]) -> list[tuple[str, float | None, str, float]]:
    """HTTPS against HTTP for s3ckpt's saves and loads: CPU per GiB and throughput."""
    checks: list[tuple[str, float | None, str, float]] = []
    for http, https, what in (("s3ckpt_save", "s3ckpt_save_https", "save"),
                              ("s3ckpt_load", "s3ckpt_load_https", "load")):  # fmt: skip
        checks.append(
            (
                f"HTTPS {what} CPU-s/GiB / HTTP",
                _ratio(summary, https, http, "cpu_s_per_gib"),
                "<=",
                1.35,
            )
        )
        checks.append((f"HTTPS {what} throughput / HTTP", _ratio(summary, https, http, "mbps_median"), ">=", 0.8))  # fmt: skip
    return checks


def _staging_checks(summary: dict[str, Any]) -> list[tuple[str, float | None, str, float]]:
    """The GPU targets: loads into CUDA tensors against their parts, and the training stall
    of async saves from CUDA tensors against a bare D2H copy."""
    loads = summary.get("gpu_load", {}).get("gpu_load")
    checks = (
        []
        if loads is None
        else [("GPU dcp.load / (network read + bare H2D copy)", loads["gpu_load_over_parts"], "<=", GPU_LOAD_TARGET)]
    )  # fmt: skip
    staging = summary.get("gpu_staging", {}).get("staging")
    if staging is None:
        return checks
    return [
        *checks,
        ("GPU dcp.async_save blocked / bare D2H copy", staging["async_blocked_over_d2h"], "<=", STAGING_TARGET),
        ("GPU CheckpointManager.save blocked / bare D2H", staging["manager_blocked_over_d2h"], "<=", STAGING_TARGET),
    ]  # fmt: skip


def _blocked_ratio(summary: dict[str, Any]) -> float | None:
    blocked = summary.get("s3ckpt_async", {}).get("blocked_median_after_first_s")
    memcpy = summary.get("memcpy", {}).get("seconds_median")
    return blocked / memcpy if blocked is not None and memcpy else None


def _rss_excess(
    summary: dict[str, Any], case: str, base: str, allowance_mib: float
) -> float | None:
    """How far ``case``'s peak RSS exceeds ``base``'s, in units of ``allowance_mib``."""
    field = "rss_over_baseline_mib"
    if field not in summary.get(case, {}) or field not in summary.get(base, {}):
        return None
    return max(summary[case][field] - summary[base][field], 0.0) / allowance_mib


def _rss_ratio(summary: dict[str, Any], case: str, staged_mib: float) -> float | None:
    over = summary.get(case, {}).get("rss_over_baseline_mib")
    return None if over is None else over / (staged_mib + 512)


def table(report: dict[str, Any]) -> str:
    summary = report["cases"]
    lines = [
        f"s3ckpt benchmark: {report['size_mib']} MiB state dict, {report['reps']} runs per case, local SeaweedFS",
        "",
    ]
    header = f"{'':38} {'MB/s med':>9} {'min':>7} {'max':>7} {'CPU s/GiB':>10} {'RSS+ MiB':>9}"
    for title, rows in (
        ("save", SAVES),
        ("load", LOADS),
        ("compression, real weights (taking turns, two processes per case)", COMPRESSION),
    ):
        lines += [f"{title}:", header]
        for case, label in rows:
            lines.append(_row(label, summary.get(case)))
        lines.append("")
    if "memcpy" in summary and "error" not in summary["memcpy"]:
        m = summary["memcpy"]
        lines.append(
            f"staging limit (copy into preallocated CPU buffers): {m['mbps_median']:.0f} MB/s, {m['seconds_median']:.3f} s"
        )
    a = summary.get("s3ckpt_async", {})
    if "blocked_first_s" in a:
        lines.append(
            f"async_save blocked: first {a['blocked_first_s']:.3f} s, then median {a['blocked_median_after_first_s']:.3f} s"
        )
    lines += _commit_lines(summary)
    lines += _tls_lines(report)
    lines += _staging_lines(summary) + _gpu_load_lines(summary)
    lines += ["", f"{'target':56} {'ratio':>7} {'goal':>8}  met"]
    for t in report["targets"]:
        ratio = "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}"
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "NO")
        lines.append(f"{t['target']:56} {ratio:>7} {t['goal']:>8}  {met}")
    return "\n".join(lines)


def _commit_lines(summary: dict[str, Any]) -> list[str]:
    """Commit latency (``finish`` of a 1 MiB save) by commit mode, and their ratio."""
    modes = [
        ("commit_conditional", "If-None-Match"),
        ("commit_claims", "claims (no conditional writes)"),
    ]
    found = [(label, summary[c]) for c, label in modes if "commit_median_s" in summary.get(c, {})]
    lines = [
        f"commit latency, {label}: median {e['commit_median_s'] * 1000:.1f} ms, max {e['commit_max_s'] * 1000:.1f} ms"
        for label, e in found
    ]
    if len(found) == 2:
        ratio = found[1][1]["commit_median_s"] / found[0][1]["commit_median_s"]
        lines.append(f"commit latency, claims / If-None-Match: {ratio:.2f}x")
    return lines


def _tls_lines(report: dict[str, Any]) -> list[str]:
    """HTTPS next to HTTP (same server, same run) and the AES-GCM floor."""
    summary = report["cases"]
    rows = [(h, s, label) for h, s, label in TLS_PAIRS if h in summary or s in summary]
    if not rows:
        return []
    lines = ["", "HTTPS against HTTP (same server; ratios HTTPS / HTTP):",
             f"{'':26} {'HTTP MB/s':>10} {'HTTPS MB/s':>11} {'ratio':>6} {'HTTP CPU':>9} {'HTTPS CPU':>10} {'ratio':>6}"]  # fmt: skip
    for http, https, label in rows:
        a, b = summary.get(http, {}), summary.get(https, {})
        if "mbps_median" not in a or "mbps_median" not in b:
            reason = b.get("skipped") or b.get("error") or a.get("error") or "not run"
            lines.append(f"  {label:24} {reason[:70]}")
            continue
        lines.append(
            f"  {label:24} {a['mbps_median']:10.0f} {b['mbps_median']:11.0f} "
            f"{b['mbps_median'] / a['mbps_median']:6.2f} {a['cpu_s_per_gib']:9.2f} "
            f"{b['cpu_s_per_gib']:10.2f} {b['cpu_s_per_gib'] / a['cpu_s_per_gib']:6.2f}"
        )
    aes = report.get("aes_gcm")
    if aes:
        lines.append(f"TLS with the server: {aes.get('negotiated_cipher', '?')}; AES-GCM on one core, "
                     f"16 KiB records ({aes['ssl_module_openssl']}, the ssl module's):")  # fmt: skip
        for bits in (128, 256):
            if f"openssl_aes{bits}_gb_per_s" in aes:
                lines.append(
                    f"  AES-{bits}-GCM {aes[f'openssl_aes{bits}_gb_per_s']:.1f} GB/s = "
                    f"{aes[f'openssl_aes{bits}_cpu_s_per_gib']:.2f} CPU-s/GiB per side"
                )
        lines.append(
            f"  AES-256-GCM through the cryptography package's own OpenSSL: "
            f"{aes['cryptography_gb_per_s']:.1f} GB/s = {aes['cryptography_cpu_s_per_gib']:.2f} CPU-s/GiB"
        )
    return lines


def _gpu_load_lines(summary: dict[str, Any]) -> list[str]:
    entry = summary.get("gpu_load")
    if entry is None:
        return []
    if "skipped" in entry or "error" in entry:
        return ["", f"GPU load: not measured: {entry.get('skipped') or entry.get('error')}"]
    g = entry["gpu_load"]
    return [
        "",
        "GPU load (into CUDA tensors through pinned bounce slabs; medians after the first load):",
        f"  network read into CPU tensors: {g['network']:.2f} s; bare pinned H2D copy: {g['h2d'] * 1000:.1f} ms",
        f"  dcp.load into CUDA tensors: {g['gpu_load']:.2f} s ({g['gpu_load_over_parts']:.2f}x their sum; "
        f"first load {g['first_gpu_load']:.2f} s)",
    ]  # fmt: skip


def _staging_lines(summary: dict[str, Any]) -> list[str]:
    entry = summary.get("gpu_staging")
    if entry is None:
        return []
    if "skipped" in entry or "error" in entry:
        return ["", f"GPU staging: not measured: {entry.get('skipped') or entry.get('error')}"]
    st = entry["staging"]
    return [
        "",
        "GPU staging (CUDA tensors, pinned buffers reused; medians after the first save):",
        f"  bare D2H copy into pinned memory: {st['d2h'] * 1000:.1f} ms",
        *(
            [
                f"  HostStager.stage alone: {st['stage'] * 1000:.1f} ms "
                f"({st['stage'] / st['d2h']:.2f}x D2H)"
            ]
            if "stage" in st
            else []
        ),
        f"  dcp.async_save blocked: {st['async_blocked'] * 1000:.1f} ms "
        f"({st['async_blocked_over_d2h']:.2f}x D2H; first save {st['first_async_blocked'] * 1000:.1f} ms), "
        f"committed after {st['async_commit']:.2f} s",
        f"  CheckpointManager.save blocked: {st['manager_blocked'] * 1000:.1f} ms "
        f"({st['manager_blocked_over_d2h']:.2f}x D2H), committed after {st['manager_commit']:.2f} s",
    ]


def _row(label: str, entry: dict[str, Any] | None) -> str:
    if entry is None:
        return f"  {label:36} {'(not run)':>9}"
    if "error" in entry:
        return f"  {label:36} failed: {entry['error'][:60]}"
    if "skipped" in entry:
        return f"  {label:36} skipped: {entry['skipped'][:60]}"
    return (f"  {label:36} {entry['mbps_median']:9.0f} {entry['mbps_min']:7.0f} {entry['mbps_max']:7.0f}"
            f" {entry['cpu_s_per_gib']:10.2f} {entry['rss_over_baseline_mib']:9.0f}")  # fmt: skip


def chart(report: dict[str, Any], path: Path) -> None:
    """Throughput and CPU per GiB, save and load, side by side."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install 's3ckpt[bench]'): no chart", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["cases"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    for col, (title, rows) in enumerate((("save", SAVES), ("load", LOADS))):
        present = [(c, label) for c, label in rows if "mbps_median" in summary.get(c, {})]
        labels = [label.replace(" (", "\n(") for _, label in present]
        colors = [
            "#888888" if "ceiling" in label else "#d62728" if c.startswith("s3ckpt") else "#1f77b4"
            for c, label in present
        ]
        for row, (field, unit) in enumerate(
            (("mbps_median", "MB/s (median)"), ("cpu_s_per_gib", "client CPU s/GiB"))
        ):
            ax = axes[row][col]
            ax.barh(labels, [summary[c][field] for c, _ in present], color=colors)
            ax.set_title(f"{title}: {unit}")
            ax.invert_yaxis()
            ax.tick_params(axis="y", labelsize=8)
    fig.suptitle(
        f"s3ckpt vs peers, {report['size_mib']} MiB, local SeaweedFS (2 cores shared with the server)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
