"""The part signer (``s3ckpt.s3.wire.signing``) against botocore's SigV4 signer: for the
same request at the same instant, every header it adds is the one botocore adds, for
path- and virtual-host-style URLs, ports, keys that need encoding, a CRC32C header, a
session token, and days and regions whose signing keys it keeps."""

from __future__ import annotations

import datetime
from urllib.parse import quote, urlsplit

import pytest
from botocore.config import Config
from botocore.credentials import ReadOnlyCredentials

from s3ckpt.s3.compat_botocore import sign_s3
from s3ckpt.s3.wire.signing import PartHeads, PartSigner, canonical_query, host_of
from s3ckpt.s3.wire.uploads import _USER_AGENT, host_header, request_head

_CONFIG = Config(signature_version="s3v4", s3={"payload_signing_enabled": False})
_KEYS = ["plain/key.bin", "with space/and+plus/ünï.bin", "a~b_c-d.e/(1)[2]!*'.bin"]
_ORIGINS = [
    "http://127.0.0.1:9000/bucket",
    "http://localhost/bucket",
    "https://bucket.s3.example.com",
    "https://s3.example.com:8443/bucket",
    "http://[::1]:9000/bucket",
]


def _url(origin: str, key: str, number: int, upload_id: str) -> str:
    query = f"partNumber={number}&uploadId={quote(upload_id, safe='-_.~')}"
    return f"{origin}/{quote(key, safe='/~')}?{query}"


def _signed_both_ways(
    url: str, headers: dict[str, str], credentials: ReadOnlyCredentials, region: str
) -> tuple[dict[str, str], dict[str, str]]:
    """``PUT url`` with ``headers`` signed by PartSigner and by botocore at the same
    instant: each one's headers, names lowercased."""
    theirs = sign_s3(
        "PUT", url, dict(headers), credentials=credentials, region=region,
        service="s3", client_config=_CONFIG,
    )  # fmt: skip
    moment = datetime.datetime.strptime(theirs["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(
        tzinfo=datetime.timezone.utc
    )
    ours = PartSigner().sign(
        urlsplit(url), headers, credentials=credentials, region=region, service="s3",
        now=moment,
    )  # fmt: skip
    return {k.lower(): v for k, v in ours.items()}, {k.lower(): v for k, v in theirs.items()}


@pytest.mark.parametrize("origin", _ORIGINS)
@pytest.mark.parametrize("key", _KEYS)
@pytest.mark.parametrize("token", [None, "session/token+=="])
@pytest.mark.parametrize("checksum", [None, "yZRlqg=="])
def test_every_header_is_the_one_botocore_signs(origin, key, token, checksum):
    credentials = ReadOnlyCredentials(
        "AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token
    )
    url = _url(origin, key, 7, "2~upload/id+with=odd chars")
    headers = {"x-amz-checksum-crc32c": checksum} if checksum else {}
    ours, theirs = _signed_both_ways(url, headers, credentials, "eu-west-3")
    assert ours == theirs


@pytest.mark.parametrize("origin", _ORIGINS)
@pytest.mark.parametrize("key", _KEYS)
@pytest.mark.parametrize("token", [None, "session/token+=="])
def test_a_whole_object_put_is_signed_as_botocore_signs_it(origin, key, token):
    """PutObject as ``ObjectStore.put`` sends it: no query, a CRC32C, ``If-None-Match``
    and a content type."""
    credentials = ReadOnlyCredentials("AKIDEXAMPLE", "secret/key+", token)
    url = f"{origin}/{quote(key, safe='/~')}"
    headers = {
        "If-None-Match": "*",
        "x-amz-checksum-crc32c": "yZRlqg==",
        "Content-Type": "application/json",
    }
    ours, theirs = _signed_both_ways(url, headers, credentials, "us-east-1")
    assert ours == theirs


def test_signing_keys_are_kept_per_secret_day_region_and_service():
    signer = PartSigner()
    credentials = ReadOnlyCredentials("AKID", "secret", None)
    url = urlsplit(_url("http://127.0.0.1:9000/b", "k", 1, "u"))
    day_one = datetime.datetime(2026, 12, 5, 23, 59, 59, tzinfo=datetime.timezone.utc)
    day_two = day_one + datetime.timedelta(seconds=2)
    first = signer.sign(url, {}, credentials=credentials, region="r1", service="s3", now=day_one)
    again = signer.sign(url, {}, credentials=credentials, region="r1", service="s3", now=day_one)
    other_day = signer.sign(
        url, {}, credentials=credentials, region="r1", service="s3", now=day_two
    )
    other_region = signer.sign(
        url, {}, credentials=credentials, region="r2", service="s3", now=day_one
    )
    assert first == again
    assert first["Authorization"] != other_day["Authorization"]
    assert "/20261206/r1/s3/" in other_day["Authorization"]
    assert first["Authorization"] != other_region["Authorization"]
    assert len(signer._keys) == 3


def test_host_and_query_in_their_canonical_forms():
    assert host_of(urlsplit("http://Example.COM:80/x")) == "example.com"
    assert host_of(urlsplit("https://example.com:443/x")) == "example.com"
    assert host_of(urlsplit("http://example.com:8080/x")) == "example.com:8080"
    assert host_of(urlsplit("http://[::1]:9000/x")) == "[::1]:9000"
    assert canonical_query("uploadId=b&partNumber=2") == "partNumber=2&uploadId=b"
    assert canonical_query("") == ""


@pytest.mark.parametrize("origin", _ORIGINS)
@pytest.mark.parametrize("token", [None, "session/token+=="])
def test_part_heads_are_the_general_signers_heads_byte_for_byte(origin, token):
    """The per-upload heads (what parts share worked out once) are the bytes that
    ``request_head`` makes of ``PartSigner.sign``'s headers, for every origin, key, upload
    id, part number and checksum, at a given instant and at the current one."""
    credentials = ReadOnlyCredentials("AKIDEXAMPLE", "secret/key+", token)
    moment = datetime.datetime(2026, 12, 5, 23, 59, 59, tzinfo=datetime.timezone.utc)
    signer = PartSigner()
    for key in _KEYS:
        base = urlsplit(f"{origin}/{quote(key, safe='/~')}")
        for upload_id in ("plain", "2~upload/id+with=odd chars"):
            heads = PartHeads(
                signer, base, upload_id, credentials=credentials, region="eu-west-3",
                service="s3", host_header=host_header(base), user_agent=_USER_AGENT,
            )  # fmt: skip
            for number, checksum in ((1, None), (7, "yZRlqg=="), (10_000, "AAAAAA==")):
                url = urlsplit(_url(f"{origin}", key, number, upload_id))
                headers = {"x-amz-checksum-crc32c": checksum} if checksum else {}
                signed = signer.sign(
                    url, headers, credentials=credentials, region="eu-west-3", service="s3",
                    now=moment,
                )  # fmt: skip
                expected = request_head("PUT", url, signed, 5 << 20)
                assert heads(number, 5 << 20, checksum, now=moment) == expected
    now = heads(3, 1, None)  # the current second, formatted once and kept
    assert b"X-Amz-Date: " in now and heads._stamp in now.decode()
