"""Which answers are not S3's (s3ckpt.s3.error_mapping), built as botocore builds them: a
body with no S3 error makes the code the HTTP status and the message its reason phrase.
S3's own 404s (NoSuchBucket, NoSuchKey, a HEAD's bare 404) keep their meaning; a web
server's pages become NotS3EndpointError naming the endpoint and the status."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from aiobotocore.session import AioSession
from botocore.exceptions import ClientError
from botocore.parsers import ResponseParserError
from botocore.stub import Stubber

from s3ckpt.catalog.doctor import endpoint_source
from s3ckpt.config import S3Config
from s3ckpt.errors import (
    BucketNotFoundError,
    NotS3EndpointError,
    ObjectNotFoundError,
    StorageError,
    TransientStorageError,
)
from s3ckpt.s3.compat_botocore import (
    ENDPOINT_KEY,
    answered_status,
    answering_endpoint,
    note_endpoints,
)
from s3ckpt.s3.error_mapping import UNSUPPORTED_CODES, check_s3_answer, translate

ENDPOINT = "http://127.0.0.1:8000"
S3_HEADERS = {"x-amz-request-id": "R1", "content-type": "application/xml"}
MOTO_HEAD = {"x-amzn-requestid": "R2", "content-type": "text/html; charset=utf-8"}
WEB_PAGE = {"content-type": "text/html; charset=utf-8", "server": "SimpleHTTP/0.6"}
EMPTY = {"content-length": "0"}
REASONS = {404: "Not Found", 403: "Forbidden", 200: "OK", 501: "Not Implemented", 503: ""}


def answer(status: int, headers: dict[str, str], code: str | None = None) -> dict[str, Any]:
    """A parsed answer as the client has it: ``code`` from an S3 error body, else the
    status (botocore's reading of a body with no S3 error)."""
    error = {"Code": code or str(status), "Message": "m" if code else REASONS[status]}
    return {
        "Error": error,
        "ResponseMetadata": {
            "HTTPStatusCode": status,
            "HTTPHeaders": headers,
            ENDPOINT_KEY: ENDPOINT,
        },
    }


def translated(operation: str, response: dict[str, Any], key: str | None = "k") -> StorageError:
    error = translate(ClientError(response, operation), operation=operation, bucket="b", key=key)
    assert isinstance(error, StorageError)
    return error


@pytest.mark.parametrize(
    ("operation", "response", "key", "expected"),
    [
        ("GetObject", answer(404, S3_HEADERS, "NoSuchKey"), "k", ObjectNotFoundError),
        ("ListObjectsV2", answer(404, S3_HEADERS, "NoSuchBucket"), None, BucketNotFoundError),
        ("HeadObject", answer(404, {"x-amz-request-id": "R", **EMPTY}), "k", ObjectNotFoundError),
        ("HeadBucket", answer(404, {"x-amz-request-id": "R", **EMPTY}), None, BucketNotFoundError),
        ("HeadObject", answer(404, MOTO_HEAD), "k", ObjectNotFoundError),  # moto says text/html
        ("HeadBucket", answer(404, EMPTY), None, BucketNotFoundError),  # no body: can't tell
        ("PutObject", answer(501, EMPTY), "k", StorageError),  # a store that lacks a feature
        ("DeleteObject", answer(503, EMPTY), "k", TransientStorageError),  # retried, then this
    ],
)
def test_s3s_answers_keep_their_meaning(operation, response, key, expected):
    error = translated(operation, response, key)
    assert type(error) is expected and "does not answer like an S3 server" not in str(error)


@pytest.mark.parametrize(
    ("operation", "response", "status"),
    [
        ("ListObjectsV2", answer(404, WEB_PAGE), 404),
        ("GetObject", answer(404, EMPTY), 404),  # no S3 error, and S3 always sends one
        ("PutObject", answer(403, WEB_PAGE), 403),
        ("HeadBucket", answer(404, WEB_PAGE), 404),  # a HEAD: a web page, no x-amz header
        ("HeadObject", answer(403, WEB_PAGE), 403),
        ("PutObject", answer(501, WEB_PAGE), 501),  # http.server's answer to a PUT
    ],
)
def test_a_web_servers_answers_are_not_s3s(operation, response, status):
    error = translated(operation, response)
    assert isinstance(error, NotS3EndpointError)
    assert str(error).startswith(f"this endpoint does not answer like an S3 server: {ENDPOINT}")
    assert f"answered {operation} s3://b/k with HTTP {status}" in str(error)
    assert error.code == str(status) and error.bucket == "b" and error.key == "k"
    # the fallbacks that test codes (commit, doctor, gc) still see a 501 as "unsupported"
    assert (error.code in UNSUPPORTED_CODES) == (status == 501)


def test_a_body_that_is_no_xml_is_not_s3s():
    error = translate(ResponseParserError("bad"), operation="ListObjectsV2", bucket="b")
    assert isinstance(error, NotS3EndpointError) and "not S3's XML" in str(error)


def test_a_web_page_answering_200_is_not_s3s():
    page = {"ResponseMetadata": {"HTTPStatusCode": 200, "HTTPHeaders": WEB_PAGE,
                                 ENDPOINT_KEY: ENDPOINT}}  # fmt: skip
    with pytest.raises(NotS3EndpointError, match=r"answered HeadBucket s3://b with HTTP 200"):
        check_s3_answer("HeadBucket", page, "b")
    html_object = {"ResponseMetadata": {"HTTPStatusCode": 200, "HTTPHeaders": {
        "content-type": "text/html", "x-amz-request-id": "R"}}}  # fmt: skip
    check_s3_answer("HeadObject", html_object, "b", "index.html")  # S3's, of an HTML object
    check_s3_answer("UploadPart", {"ETag": '"e"'}, "b", "k")  # the data plane's own answer


def test_the_answering_endpoint_is_read_back():
    assert answering_endpoint(answer(404, EMPTY)) == ENDPOINT
    assert answering_endpoint({"ResponseMetadata": {}}) is None


# -- where doctor says the endpoint came from (no request is sent) ----------------------


@pytest.fixture
def aws_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    config = tmp_path / "config"
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    return config


def test_the_source_of_each_configured_endpoint(aws_config, monkeypatch):
    aws_config.write_text(
        "[default]\nendpoint_url = http://global:1\n"
        "[profile dev]\nservices = local\n[services local]\ns3 =\n  endpoint_url = http://svc:2\n"
    )
    default, dev = S3Config(), S3Config(profile="dev")
    assert endpoint_source(default, "http://global:1") == (
        f"from the endpoint_url of profile default in {aws_config}"
    )
    assert endpoint_source(dev, "http://svc:2") == (
        f"from s3's endpoint_url in [services local] of profile dev in {aws_config}"
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://env:3")
    assert endpoint_source(default, "http://env:3") == "from AWS_ENDPOINT_URL"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://env-s3:4")
    assert endpoint_source(default, "http://env-s3:4") == "from AWS_ENDPOINT_URL_S3"
    given = S3Config(endpoint_url="http://given:5")
    assert endpoint_source(given, "http://given:5") == "from --endpoint-url / S3Config.endpoint_url"


def test_an_endpoint_in_a_profiles_own_s3_section_is_said_to_be_unread(aws_config):
    aws_config.write_text("[default]\ns3 =\n  endpoint_url = http://nested:6\n")
    source = endpoint_source(S3Config(), "https://s3.amazonaws.com")
    assert source.startswith("AWS's own endpoint: none configured")
    assert "http://nested:6 in the s3 section of profile default is not read" in source


def test_the_client_notes_the_endpoint_and_status_of_its_answers():
    """botocore's after-call event reaches the hook with errors too (a botocore release
    that stops emitting it there fails here)."""

    async def head() -> ClientError:
        async with AioSession().create_client(
            "s3", region_name="us-east-1", endpoint_url=ENDPOINT,
            aws_access_key_id="a", aws_secret_access_key="b",
        ) as client:  # fmt: skip
            note_endpoints(client)
            with Stubber(client) as stub:
                stub.add_client_error("head_bucket", "404", http_status_code=404)
                with pytest.raises(ClientError) as raised:
                    await client.head_bucket(Bucket="b")
        return raised.value

    error = asyncio.run(head())
    assert answering_endpoint(error.response) == ENDPOINT
    assert answered_status(error.response) == 404
