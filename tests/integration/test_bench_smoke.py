"""The benchmark harness runs end to end at tiny sizes (timings are not asserted).

The benchmarks with a process per case fork their cases from one process that imported
them (``--fork-cases``, benchmarks/zygote.py): each case runs as in ``make bench``, its own
process and its ``__main__``, without importing torch again;
tests/unit/benchmarks/test_zygote.py holds a forked case to what a fresh interpreter does.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_smoke_run(tmp_path):
    https = "raw_upload_https,s3ckpt_save_https,s3ckpt_load_https,curl_download_https"
    cases = f"raw_upload,s3ckpt_save,s3ckpt_load,curl_download,{https},gpu_staging"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--size-mib",
            "1",
            "--reps",
            "1",
            "--cases",
            cases,
            "--out",
            str(tmp_path),
            "--fork-cases",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    report = json.loads((tmp_path / "bench.json").read_text())["report"]
    for case in cases.split(",")[:-1]:
        if case.startswith("curl") and shutil.which("curl") is None:
            assert report["cases"][case]["skipped"] == "curl not found"
            continue
        assert "mbps_median" in report["cases"][case], report["cases"][case]
    assert "HTTPS against HTTP" in completed.stdout
    assert report["aes_gcm"]["cryptography_gb_per_s"] > 0
    gpu = report["cases"]["gpu_staging"]
    if torch.cuda.is_available():
        assert gpu["staging"]["d2h"] > 0
    else:  # the case says why it did not run, in the report and on the terminal
        assert gpu["skipped"].startswith("no CUDA"), gpu
        assert "GPU staging: not measured: no CUDA" in completed.stdout
    assert "save throughput / raw upload" in completed.stdout
    assert report["targets"][0]["target"] == "save throughput / raw upload"
    assert report["targets"][0]["ratio"] > 0


def test_loop_benchmark_smoke_run(tmp_path):
    """The loop benchmark's cases run, in both placements, and report each measure."""
    import os

    modes = "manager_default,checkpoint_process,dcp_thread,floor_process"
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.loop", "--size-mib", "8", "--reps", "1",
         "--loops", "dispatch", "--modes", modes, "--out", str(tmp_path), "--fork-cases"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "BENCH_LOOP_ALONE_S": "0.2"},
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    report = json.loads((tmp_path / "loop.json").read_text())
    assert report["state"] == "nested"  # saved as trainers pass it: one top-level entry
    rows = {(r["mode"], r["placement"]): r for r in report["cases"]}
    assert set(rows) == {(m, p) for m in ["alone", *modes.split(",")] for p in ("shared", "pinned")}
    for (mode, _), row in rows.items():
        assert row["error"] is None, row
        assert row["step_alone_us"] > 0 and row["step_cpu_alone_us"] > 0, row
        if mode != "alone":
            assert row["slowdown"] is not None and row["upload_s"] > 0, row
            assert row["lost_s_per_gib"] >= 0 and row["blocked_s"] > 0, row
            assert row["full_collections"] >= 0, row
            # the slowdown's two factors, from the loop thread's own clock and sleeps
            (rep,) = row["reps"]
            factors = (1 + rep["waiting"]) * (1 + rep["cpu_growth"])
            alone_ratio = rep["step_alone_us"] / rep["step_cpu_alone_us"]
            assert factors == pytest.approx((1 + rep["slowdown"]) * alone_ratio, rel=1e-6)
            assert rep["sleeps"] >= 0, rep
            if rep["upload_s"] > 0.01:  # an upload over before the loop's first steps
                # leaves one step's clocks, whose ratio is noise
                assert rep["waiting"] > -0.05, rep
            off_core = rep["upload_s"] * rep["waiting"] / (1 + rep["waiting"])
            lost_waiting = (rep["blocked_s"] + off_core) / row["gib"]
            assert rep["lost_waiting_s_per_gib"] == pytest.approx(lost_waiting), rep
            # each over-the-copy ratio against the bare copy timed beside its own save
            assert rep["copy_s"] > 0 and row["copy_s_per_gib"] == rep["copy_s"] / row["gib"]
            assert rep["blocked_over_copy"] == pytest.approx(rep["blocked_s"] / rep["copy_s"])
            assert row["lost_over_copy"] == pytest.approx(
                rep["lost_s_per_gib"] * row["gib"] / rep["copy_s"]
            ), row
    assert {t["target"].split(":")[0] for t in report["targets"]} == {
        "dispatch beside manager_default", "dispatch beside dcp_thread"
    }  # fmt: skip
    assert "The loop beside a save" in completed.stdout


def test_memory_tier_benchmark_smoke_run(tmp_path):
    """The memory tier benchmark's two ranks save, replicate and restore from every tier,
    bit-exact, and report each measure."""
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory_tier", "--size-mib", "8", "--tensors", "4",
         "--saves", "3", "--peers", "nvrx", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    report = json.loads((tmp_path / "memory_tier.json").read_text())
    assert report["sources"] == {
        "own": ["memory", "memory"], "peer": ["memory", "memory"], "s3": ["s3", "s3"]
    }  # fmt: skip
    assert report["exact"] == {"own": True, "peer": True, "s3": True}
    # one process restores both ranks' state: from node 0's copies (resharded), and S3
    resharded = report["resharded"]
    assert [resharded[s]["tier"] for s in ("memory", "s3")] == ["memory", "s3"]
    assert all(r["exact"] and r["total_s"] > 0 for r in resharded.values()), resharded
    assert all(seconds > 0 for seconds in report["seconds"].values()), report["seconds"]
    assert [t["target"] for t in report["targets"]] == [
        "save blocking / bare copy", "own restore / bare copy", "peer restore / link throughput"
    ]  # fmt: skip
    for rank in report["loop_beside_replication"]["ranks"]:
        assert rank["step_alone_s"] > 0 and rank["step_during_s"] > 0 and rank["background_s"] > 0
    lost = report["steps_lost"]
    assert lost["every"] == 10 and lost["s3_every"] == 100
    # half an interval plus the measured time to restorable and to restore, in steps of 1 s
    # (which of the two tiers is quicker at 8 MiB is noise, so it is not compared here)
    seconds = report["seconds"]
    assert lost["s3ckpt"] == pytest.approx([
        5 + seconds["held locally after"] + seconds["restore, own copy"],
        5 + seconds["replicated after"] + seconds["restore, from the peer (node lost)"],
    ])  # fmt: skip
    assert lost["S3 alone, every 100 steps"] == pytest.approx(
        50 + seconds["upload to S3 (a save also to S3)"] + seconds["restore, from S3"]
    )
    nvrx = report["peers"]["nvrx"]  # run beside it where its environment is installed
    if nvrx["ran"]:
        assert nvrx["exact"] == {"own": True, "peer": True} and len(lost["nvrx"]) == 2
    else:
        assert nvrx["why"] == ".venv-tierpeers is not installed"


def test_staging_benchmark_smoke_run(tmp_path):
    """The staging benchmark times the manager's blocking against a bare copy, per state."""
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.staging", "--size-mib", "8", "--small", "200",
         "--saves", "3", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    cases = json.loads((tmp_path / "staging.json").read_text())["cases"]
    assert [c["tensors"] for c in cases] == [580, 200]
    assert all(c["blocked_s"] > 0 and c["copy_s"] > 0 for c in cases), cases
    assert "target" in completed.stdout


def test_torch_checkpointing_benchmark_smoke_run(tmp_path):
    """The torch-checkpointing benchmark saves and restores every way, bit-exact."""
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.torch_checkpointing", "--size-mib", "8",
         "--tensors", "2", "--reps", "1", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    report = json.loads((tmp_path / "torch_checkpointing.json").read_text())
    assert report["exact"] == {"tc-tmpfs": True, "tc-s3": True, "dcp-s3": True}
    assert set(report["ratios"]) == {"tc-s3 / tc-tmpfs", "tc-s3 / dcp-s3"}
    assert all(s > 0 for m in report["seconds"].values() for s in m.values()), report["seconds"]


def test_mlperf_checkpoint_benchmark_smoke_run(tmp_path):
    """MLPerf Storage's checkpoint workload, scaled down: two ranks write and read back
    bit-exact, reported as the slowest rank's duration and the smallest rank's throughput."""
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.mlperf_checkpoint", "--scale", "0.0005",
         "--checkpoints", "2", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    report = json.loads((tmp_path / "mlperf_checkpoint.json").read_text())
    assert report["exact"] and report["workload"]["ranks"] == 2
    assert report["workload"]["mlperf_ranks"] == 8  # llama3-8b
    for kind in ("write", "read"):
        figures = report["figures"][kind]
        assert figures["runs"] == 2 and figures["slowest_rank_s"] > 0
        assert 0 < figures["smallest_rank_GBps"] <= figures["aggregate_GBps"]


def test_durable_benchmark_smoke_run(tmp_path):
    """The time-to-durable benchmark runs a user's script per mode in a process of its own and
    reports each save's times, the ratios and the verdict (never a failure on them).
    Most of its time is process mode's: its checkpoint process starts and imports torch."""
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.durable", "--size-mib", "4", "--reps", "1",
         "--loads", "0", "--modes", "process,thread", "--saves", "3", "--every-s", "0.3",
         "--alone-s", "0.1", "--out", str(tmp_path), "--fork-cases"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    report = json.loads((tmp_path / "durable.json").read_text())
    rows = {(r["mode"], r["load"]): r for r in report["rows"]}
    assert set(rows) == {("process", 0), ("thread", 0)}
    for row in rows.values():
        assert row["runs"] == 1 and row["errors"] == [], row
        for field in ("construct_s", "first_to_held_s", "first_to_committed_s",
                      "warm_to_committed_s", "second_blocked_s", "close_s"):  # fmt: skip
            assert row[field]["best"] == row[field]["median"] >= 0, (field, row)
        assert row["first_to_replicated_s"] is None  # one node: no peer to replicate to
    for case in report["cases"]:
        saves = case["saves"]
        assert [s["step"] for s in saves] == [1, 2, 3]
        for save in saves:  # the copy is made before the commit, both after the call
            assert 0 < save["to_held_s"] <= save["to_committed_s"], save
        assert case["close_after_commit_s"] <= case["close_s"]
    (ratio,) = report["ratios"]
    assert ratio["load"] == 0 and ratio["first_to_committed_s"] > 0
    assert {t["target"] for t in report["targets"]} >= {
        "0 busy: process / thread time to committed, first save",
        "0 busy, thread: close() after the last commit, s",
    }  # fmt: skip
    assert "Verdict (printed, not a test)" in completed.stdout
    assert "| process | 0 |" in completed.stdout and "| thread | 0 |" in completed.stdout
