"""``s3ckpt doctor`` against both servers, and against a proxy that takes features away."""

from __future__ import annotations

import json
from typing import Any

import pytest
from faultproxy import FaultProxy, Rule
from s3_servers import ON_BOTH

from s3ckpt.cli.main import main

pytestmark = [pytest.mark.integration]

CHECKS = {
    "endpoint and TLS",
    "credentials and bucket",
    "list, put, get, delete",
    "conditional writes",
    "conditional deletes",
    "CRC32C on uploads",
    "multipart uploads",
    "ranged GETs",
    "ListMultipartUploads",
    "throughput sample",
}


@pytest.fixture
def doctor(local_s3: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    for name, value in local_s3.env().items():
        monkeypatch.setenv(name, value)

    def run(uri: str, endpoint: str | None = None) -> tuple[int, dict[str, Any]]:
        code = main(["doctor", uri, "--endpoint-url", endpoint or local_s3.endpoint_url,
                     "--sample-mib", "2", "--json"])  # fmt: skip
        return code, json.loads(capsys.readouterr().out)

    return run


@ON_BOTH
def test_doctor_probes_every_feature_and_cleans_up(local_s3, s3_prefix, doctor, list_keys):
    code, report = doctor(s3_prefix)
    statuses = {c["check"]: c["status"] for c in report["checks"]}
    assert set(statuses) == CHECKS
    assert "failed" not in statuses.values()
    assert any("conditional create" in step for step in report["plan"])
    if type(local_s3).__name__ == "MotoS3Server":  # moto does not check CRC32C on uploads
        assert statuses["CRC32C on uploads"] == "degraded" and code == 1
    else:
        assert set(statuses.values()) == {"ok"} and code == 0
    assert report["exit_status"] == code
    assert list_keys(s3_prefix) == []  # the scratch prefix is gone


def test_doctor_reports_what_a_store_lacks_and_the_fallbacks(local_s3, s3_prefix, doctor):
    with FaultProxy(local_s3.endpoint_url, conditional="reject") as proxy:
        proxy.add(Rule("not_implemented", methods=("GET",), match="?uploads", per_request=None))
        code, report = doctor(s3_prefix, proxy.endpoint_url)
    statuses = {c["check"]: c["status"] for c in report["checks"]}
    assert code == 1
    assert statuses["conditional writes"] == "degraded"
    assert statuses["conditional deletes"] == "degraded"
    assert statuses["ListMultipartUploads"] == "degraded"
    assert any("claim protocol" in step for step in report["plan"])
    assert any("re-check a manifest" in step for step in report["plan"])


def test_doctor_says_when_a_store_ignores_conditional_deletes(local_s3, s3_prefix, doctor):
    with FaultProxy(
        local_s3.endpoint_url, conditional="ignore", secret_key=local_s3.secret_key
    ) as proxy:
        code, report = doctor(s3_prefix, proxy.endpoint_url)
    checks = {c["check"]: c for c in report["checks"]}
    assert code == 1 and checks["conditional deletes"]["status"] == "degraded"
    assert "ignored" in checks["conditional deletes"]["detail"]
    assert checks["conditional writes"]["status"] == "degraded"  # If-None-Match is ignored too


def test_doctor_says_when_s3ckpt_cannot_work(s3_prefix, doctor):
    code, report = doctor("s3://no-such-bucket-s3ckpt/run")
    assert code == 2 and report["checks"][0]["status"] == "failed"
    assert "no such bucket" in report["checks"][0]["detail"]
