"""``s3ckpt doctor`` against both servers, against a proxy that takes features away, and
with its endpoint from each source botocore reads (a fresh process, as a user runs it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from faultproxy import FaultProxy, Rule
from s3_servers import ON_BOTH

from s3ckpt.cli.main import main

CHECKS = {
    "endpoint and TLS",
    "credentials and bucket",
    "list, put, get, delete",
    "bucket versioning",
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


# -- which endpoint, from where: doctor run as a user runs it ----------------------------

UNUSED = "http://127.0.0.1:9"  # nothing listens there: a source that loses must not be used


def run_doctor(uri: str, env: dict[str, str], *args: str) -> tuple[int, dict[str, Any]]:
    """``s3ckpt doctor --json`` in a fresh process with ``env`` as its AWS environment."""
    command = shutil.which("s3ckpt", path=str(Path(sys.executable).parent))
    assert command is not None, "the s3ckpt console script is not installed beside python"
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    result = subprocess.run(
        [command, "doctor", uri, "--sample-mib", "1", "--read-timeout", "10s", "--json", *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result.returncode, json.loads(result.stdout)


@pytest.fixture
def aws_files(local_s3: Any, tmp_path: Path) -> dict[str, str]:
    """Credentials in the environment, empty AWS config and credentials files beside."""
    config, credentials = tmp_path / "config", tmp_path / "credentials"
    config.write_text("")
    credentials.write_text(
        f"[dev]\naws_access_key_id = {local_s3.access_key}\n"
        f"aws_secret_access_key = {local_s3.secret_key}\n"
    )
    return {
        "AWS_ACCESS_KEY_ID": local_s3.access_key,
        "AWS_SECRET_ACCESS_KEY": local_s3.secret_key,
        "AWS_DEFAULT_REGION": local_s3.region,
        "AWS_CONFIG_FILE": str(config),
        "AWS_SHARED_CREDENTIALS_FILE": str(credentials),
    }


def endpoint_line(report: dict[str, Any]) -> str:
    check = next(c for c in report["checks"] if c["check"] == "endpoint and TLS")
    assert check["status"] == "ok"
    return str(check["detail"])


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("case", "source"),
    [
        ("--endpoint-url", "from --endpoint-url"),
        ("AWS_ENDPOINT_URL", "from AWS_ENDPOINT_URL"),
        ("AWS_ENDPOINT_URL_S3", "from AWS_ENDPOINT_URL_S3"),
        ("profile endpoint_url", "from the endpoint_url of profile default in "),
        ("services section, AWS_PROFILE", "from s3's endpoint_url in [services local] of profile dev"),
        ("services section, --profile", "from s3's endpoint_url in [services local] of profile dev"),
    ],
)  # fmt: skip
def test_doctor_reports_the_endpoint_requests_use_and_its_source(
    local_s3, s3_prefix, aws_files, case, source
):
    url, env, args = local_s3.endpoint_url, dict(aws_files), []
    config = Path(env["AWS_CONFIG_FILE"])
    if case == "--endpoint-url":
        env["AWS_ENDPOINT_URL"] = UNUSED
        args = ["--endpoint-url", url]
    elif case == "AWS_ENDPOINT_URL":
        env["AWS_ENDPOINT_URL"] = url
        config.write_text(f"[default]\nendpoint_url = {UNUSED}\n")  # the environment wins
    elif case == "AWS_ENDPOINT_URL_S3":
        env.update(AWS_ENDPOINT_URL=UNUSED, AWS_ENDPOINT_URL_S3=url)
    elif case == "profile endpoint_url":
        config.write_text(f"[default]\nendpoint_url = {url}\n")
    else:
        config.write_text(
            f"[default]\nendpoint_url = {UNUSED}\n"
            "[profile dev]\nservices = local\n"
            f"[services local]\ns3 =\n  endpoint_url = {url}\n"
        )
        if case.endswith("AWS_PROFILE"):
            env["AWS_PROFILE"] = "dev"
        else:  # an explicit profile takes its credentials from the files, not the environment
            args = ["--profile", "dev"]
    code, report = run_doctor(s3_prefix, env, *args)
    assert code in (0, 1), report
    assert report["endpoint"] == url
    assert report["endpoint_source"].startswith(source), report["endpoint_source"]
    line = endpoint_line(report)
    assert line.startswith(f"{url} ({source}")
    assert "the connection is not encrypted" in line and "TLS verified" not in line
    statuses = {c["check"]: c["status"] for c in report["checks"]}
    assert statuses["credentials and bucket"] == "ok"  # the requests went there too


@pytest.mark.subprocess
def test_doctor_names_the_endpoint_when_the_bucket_is_missing(local_s3, aws_files):
    code, report = run_doctor("s3://no-such-bucket-s3ckpt/run", {**aws_files,
                              "AWS_ENDPOINT_URL": local_s3.endpoint_url})  # fmt: skip
    assert code == 2 and report["endpoint"] == local_s3.endpoint_url
    detail = report["checks"][0]["detail"]
    assert "no such bucket" in detail
    assert f"endpoint {local_s3.endpoint_url}, from AWS_ENDPOINT_URL" in detail
