"""The benchmark report's HTTPS and GPU staging parts, on made-up measurements."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu import cuda_skip_reason, gpu_load_summary, staging_summary
from benchmarks.report import table, targets


def test_the_gpu_case_says_why_it_cannot_run_here():
    reason = cuda_skip_reason()
    if torch.cuda.is_available():
        assert reason is None
    else:
        assert reason is not None and reason.startswith("no CUDA")


def _sample(d2h: float, blocked: float) -> dict[str, float]:
    return {"d2h": d2h, "async_blocked": blocked, "async_commit": 2.0,
            "manager_blocked": blocked * 1.1, "manager_commit": 2.5}  # fmt: skip


def test_staging_is_summarised_after_the_first_save():
    samples = [_sample(0.10, 0.90), _sample(0.10, 0.11), _sample(0.10, 0.13), _sample(0.2, 0.2)]
    summary = staging_summary(samples)
    assert summary["first_async_blocked"] == 0.90  # allocating the pinned buffers
    assert summary["d2h"] == pytest.approx(0.10)
    assert summary["async_blocked"] == pytest.approx(0.13)
    assert summary["async_blocked_over_d2h"] == pytest.approx(1.3)


def _case(mbps: float, cpu: float) -> dict[str, float]:
    return {"mbps_median": mbps, "mbps_min": mbps, "mbps_max": mbps, "seconds_median": 1.0,
            "cpu_s_per_gib": cpu, "rss_over_baseline_mib": 10.0, "bytes": 2**30}  # fmt: skip


def test_https_is_reported_against_http_with_its_targets():
    cases = {
        "s3ckpt_save": _case(1000, 1.0), "s3ckpt_save_https": _case(900, 1.2),
        "s3ckpt_load": _case(1000, 1.0), "s3ckpt_load_https": _case(700, 1.5),
        "gpu_staging": {"skipped": "no CUDA: test"},
    }  # fmt: skip
    checks = {t["target"]: t for t in targets(cases)}
    assert checks["HTTPS save CPU-s/GiB / HTTP"]["ratio"] == pytest.approx(1.2)
    assert checks["HTTPS save CPU-s/GiB / HTTP"]["met"] is True
    assert checks["HTTPS load CPU-s/GiB / HTTP"]["met"] is False
    assert checks["HTTPS load throughput / HTTP"]["ratio"] == pytest.approx(0.7)
    assert checks["HTTPS load throughput / HTTP"]["met"] is False
    assert not any(name.startswith("GPU") for name in checks)  # not measured: no target row
    report = {"size_mib": 1024, "reps": 1, "cases": cases, "targets": targets(cases),
              "aes_gcm": {"ssl_module_openssl": "OpenSSL 3", "openssl_aes128_gb_per_s": 5.0,
                          "openssl_aes128_cpu_s_per_gib": 0.21, "cryptography_gb_per_s": 10.0,
                          "cryptography_cpu_s_per_gib": 0.1, "negotiated_cipher": "TLSv1.3 X"}}  # fmt: skip
    text = table(report)
    assert "HTTPS against HTTP" in text and "AES-128-GCM 5.0 GB/s" in text
    assert "TLSv1.3 X" in text
    assert "GPU staging: not measured: no CUDA: test" in text


def test_measured_gpu_staging_gets_target_rows():
    cases = {"gpu_staging": {**_case(1000, 1.0), "staging": staging_summary([_sample(0.1, 0.11)])}}
    checks = {t["target"]: t for t in targets(cases)}
    assert checks["GPU dcp.async_save blocked / bare D2H copy"]["met"] is True


def _load_sample(network: float, h2d: float, gpu: float) -> dict[str, float]:
    return {"network": network, "h2d": h2d, "gpu_load": gpu}


def test_gpu_loads_are_measured_against_the_network_read_plus_a_bare_copy():
    samples = [
        _load_sample(1.0, 0.1, 3.0),
        _load_sample(1.0, 0.1, 1.2),
        _load_sample(1.0, 0.1, 1.3),
    ]
    summary = gpu_load_summary(samples)
    assert summary["first_gpu_load"] == 3.0  # pinning the slabs
    assert summary["gpu_load_over_parts"] == pytest.approx(1.25 / 1.1)
    checks = {
        t["target"]: t for t in targets({"gpu_load": {**_case(1000, 1.0), "gpu_load": summary}})
    }
    row = checks["GPU dcp.load / (network read + bare H2D copy)"]
    assert row["ratio"] == pytest.approx(1.25 / 1.1) and row["met"] is True
    text = table({"size_mib": 1024, "reps": 3, "cases": {"gpu_load": {"skipped": "no CUDA: x"}},
                  "targets": []})  # fmt: skip
    assert "GPU load: not measured: no CUDA: x" in text
