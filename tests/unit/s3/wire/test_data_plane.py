"""A save's control requests built, signed and answered on the data plane
(``s3ckpt.s3.wire.data_plane.SignedCalls``) against scripted servers on loopback: each
request is the one the aiobotocore client sends for the same call (request line, body,
every header but the time, the user agent and the SDK's own), signed as botocore signs
it, and each answer (success, error, a 200 that carries an error, an encoded listing)
comes back as the client returns or raises it. Its HEADs: what is sent, that a HEAD's
answer (a ``Content-Length`` and no body) is read whole, that an answer is what the
client's own path returns or raises, and that a redirect hands HEADs to the client. Real
signatures are checked by SeaweedFS, which every integration test's save goes through
(tests/integration/test_signed_parts.py)."""

from __future__ import annotations

import datetime
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import pytest
from botocore.config import Config
from botocore.credentials import ReadOnlyCredentials
from botocore.exceptions import ClientError
from scripted_servers import ScriptedServers

from s3ckpt.config import S3Config
from s3ckpt.errors import BucketNotFoundError
from s3ckpt.s3.client import client_handle
from s3ckpt.s3.compat_botocore import sign_s3
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.s3.transport import Transport
from s3ckpt.s3.wire import DataPlane
from s3ckpt.s3.wire.signing import PartSigner

_NS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'
_CREATED = (
    f"<InitiateMultipartUploadResult {_NS}><Bucket>bucket</Bucket><Key>run a/obj</Key>"
    "<UploadId>up+/=1</UploadId></InitiateMultipartUploadResult>"
)
_COMPLETED = (
    f"<CompleteMultipartUploadResult {_NS}><Location>http://h/bucket/run%20a/obj</Location>"
    '<Bucket>bucket</Bucket><Key>run a/obj</Key><ETag>"etag-2"</ETag>'
    "</CompleteMultipartUploadResult>"
)
_LISTED = (
    f"<ListBucketResult {_NS}><Name>bucket</Name><Prefix>run%20a/</Prefix>"
    "<Delimiter>/</Delimiter><KeyCount>2</KeyCount><MaxKeys>1000</MaxKeys>"
    "<EncodingType>url</EncodingType><IsTruncated>true</IsTruncated>"
    "<NextContinuationToken>next+token</NextContinuationToken>"
    "<Contents><Key>run%20a/x%0Ay%26z</Key><LastModified>2026-12-04T10:00:00.000Z</LastModified>"
    '<ETag>"e-1"</ETag><Size>5</Size><StorageClass>STANDARD</StorageClass></Contents>'
    "<CommonPrefixes><Prefix>run%20a/sub%3F/</Prefix></CommonPrefixes></ListBucketResult>"
)
_DELETED = f"<DeleteResult {_NS}></DeleteResult>"
_NOT_DELETED = (
    f"<DeleteResult {_NS}><Error><Key>run a/x</Key><Code>AccessDenied</Code>"
    "<Message>no</Message></Error></DeleteResult>"
)
_ERROR = (
    "<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>"
)
_NO_UPLOAD = "<Error><Code>NoSuchUpload</Code><Message>The upload does not exist.</Message></Error>"
_PARTS = [
    {"PartNumber": 1, "ETag": '"e&1"', "ChecksumCRC32C": "AAAAAA=="},
    {"PartNumber": 2, "ETag": '"e<2>"'},
]

Send = Callable[[Transport], Awaitable[dict[str, Any]]]
# (operation, one try of it through a transport, what the server answers)
CALLS: list[tuple[str, Send, tuple[int, str]]] = [
    (
        "CreateMultipartUpload",
        lambda t: t.create_multipart_upload("bucket", "run a/obj", checksum=False),
        (200, _CREATED),
    ),
    (
        "CreateMultipartUpload",
        lambda t: t.create_multipart_upload("bucket", "run a/ü~*+obj", checksum=True),
        (200, _CREATED),
    ),
    (
        "CompleteMultipartUpload",
        lambda t: t.complete_multipart_upload(
            "bucket", "run a/obj", "up+/=1", _PARTS, create=False
        ),
        (200, _COMPLETED),
    ),
    (
        "CompleteMultipartUpload",
        lambda t: t.complete_multipart_upload("bucket", "run a/obj", "up", _PARTS, create=True),
        (200, _COMPLETED),
    ),
    ("ListObjectsV2", lambda t: t.list_objects("bucket", "run a/"), (200, _LISTED)),
    (
        "ListObjectsV2",
        lambda t: t.list_objects(
            "bucket", "run a/", delimiter="/", continuation_token="next+token"
        ),
        (200, _LISTED),
    ),
    (
        "ListObjectsV2",
        lambda t: t.list_objects("bucket", "run a/", start_after="run a/x\ny&z"),
        (200, _LISTED),
    ),
    (
        "DeleteObjects",
        lambda t: t.delete_objects("bucket", [{"Key": "run a/x"}, {"Key": "k\r\n&<2>"}]),
        (200, _DELETED),
    ),
    (
        "DeleteObjects",
        lambda t: t.delete_objects("bucket", [{"Key": "run a/x"}]),
        (200, _NOT_DELETED),
    ),
]
# What the data plane does not sign itself: the client sends it.
HANDED_OVER: list[tuple[str, Send]] = [
    ("AbortMultipartUpload", lambda t: t.abort_multipart_upload("bucket", "run a/obj", "up")),
    ("ListMultipartUploads", lambda t: t.list_multipart_uploads("bucket", "run a/")),
    ("ListObjectVersions", lambda t: t.list_object_versions("bucket", "run a/")),
    ("CopyObject", lambda t: t.copy_object("bucket", "run a/copy", "bucket", "run a/obj")),
    (
        "UploadPartCopy",
        lambda t: t.upload_part_copy(
            "bucket", "run a/copy", "up", 1, ("bucket", "run a/obj", 0, 5)
        ),
    ),
    ("DeleteObject", lambda t: t.delete_object("bucket", "run a/obj", if_match='"e-1"')),
    ("GetBucketVersioning", lambda t: t.get_bucket_versioning("bucket")),
    ("GetBucketLifecycleConfiguration", lambda t: t.get_bucket_lifecycle_configuration("bucket")),
]
# Headers that differ between two sends of the same request: the time and what it signs,
# who sends it, the SDK's per-attempt headers, and aiohttp's (an identity encoding asked
# for, which is what a request that asks for none gets).
_PER_SEND = {
    "authorization", "x-amz-date", "user-agent", "amz-sdk-invocation-id", "amz-sdk-request",
    "accept", "accept-encoding",
}  # fmt: skip


def _answer(status: int, body: str) -> bytes:
    reason = {200: "OK", 301: "Moved Permanently", 404: "Not Found", 500: "Server Error"}
    data = body.encode()
    head = f"HTTP/1.1 {status} {reason[status]}\r\nContent-Length: {len(data)}\r\n"
    if status == 301:
        head += "x-amz-bucket-region: eu-west-1\r\n"
    return (head + "\r\n").encode() + data


def _config(serve: ScriptedServers, port: int, direct: bool, token: str | None) -> S3Config:
    return serve.client(
        S3Config(
            endpoint_url=f"http://127.0.0.1:{port}",
            access_key_id="AKIDCALLS",
            secret_access_key="calls-secret",
            session_token=token,
            region="eu-west-2",
            max_attempts=1,
            direct_uploads=direct,
        )
    )


def _try(config: S3Config, send: Send) -> dict[str, Any]:
    """One try of ``send`` through the transport of ``config``'s client."""

    async def once() -> dict[str, Any]:
        return await send(await client_handle(config).transport())

    return io_loop().run(once())


def _sent(head: bytes) -> tuple[str, dict[str, str]]:
    line, *lines = head.decode("latin-1").split("\r\n")
    return line, {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in lines if h)}


def _one(
    serve: ScriptedServers,
    direct: bool,
    send: Send,
    answer: tuple[int, str],
    token: str | None = None,
) -> tuple[Any, bytes, bytes]:
    """What one try of ``send`` returns (or raises), and the head and body it sent."""
    return _both(serve, send, answer, token, (direct,))[0]


def _both(
    serve: ScriptedServers,
    send: Send,
    answer: tuple[int, str],
    token: str | None = None,
    ways: tuple[bool, ...] = (True, False),
) -> list[tuple[Any, bytes, bytes]]:
    """:func:`_one` for each way (data plane, client), to the same server."""
    server, heads = serve(lambda _: _answer(*answer))
    sent = []
    for number, direct in enumerate(ways):
        config = _config(serve, server.port, direct, token)
        try:
            result: Any = _try(config, send)
            result.pop("ResponseMetadata", None)
        except ClientError as exc:
            result = (type(exc).__name__, exc.response["Error"], exc.operation_name)
        assert len(heads) == number + 1
        sent.append((result, heads[number], server.bodies[number]))
    return sent


@pytest.mark.parametrize(("operation", "send", "answer"), CALLS)
def test_each_request_and_answer_is_the_clients(serve, operation, send, answer):
    (ours, our_head, our_body), (theirs, their_head, their_body) = _both(
        serve, send, answer, token="tok/1"
    )
    assert b"s3ckpt/" in our_head and b"aiobotocore" in their_head
    our_line, our_fields = _sent(our_head)
    their_line, their_fields = _sent(their_head)
    assert our_line == their_line
    assert our_body == their_body
    assert {k: v for k, v in our_fields.items() if k not in _PER_SEND} == {
        k: v for k, v in their_fields.items() if k not in _PER_SEND
    }
    # the same headers signed (which headers, not when)
    assert (
        our_fields["authorization"].split("SignedHeaders=")[1].split(",")[0]
        == (their_fields["authorization"].split("SignedHeaders=")[1].split(",")[0])
    )
    assert ours == theirs


@pytest.mark.parametrize(("operation", "send", "answer"), CALLS[::2])
def test_each_request_is_signed_as_botocore_signs_it(serve, operation, send, answer):
    """The client's own request, signed again by the data plane's signer at the client's
    instant, carries the client's signature."""
    _, head, _ = _one(serve, False, send, answer, token="tok/1")
    line, fields = _sent(head)
    method, target, _ = line.split(" ")
    signed = fields["authorization"].split("SignedHeaders=")[1].split(",")[0].split(";")
    headers = {name: fields[name] for name in signed if name not in ("host", "x-amz-date")}
    headers.pop("x-amz-content-sha256")
    headers.pop("x-amz-security-token")
    moment = datetime.datetime.strptime(fields["x-amz-date"], "%Y%m%dT%H%M%SZ").replace(
        tzinfo=datetime.timezone.utc
    )
    ours = PartSigner().sign(
        urlsplit(f"http://{fields['host']}{target}"), headers,
        credentials=ReadOnlyCredentials("AKIDCALLS", "calls-secret", "tok/1"),
        region="eu-west-2", service="s3", now=moment, method=method,
    )  # fmt: skip
    assert ours["Authorization"] == fields["authorization"]


@pytest.mark.parametrize(
    ("operation", "send", "answer"),
    [
        (*CALLS[2][:2], (200, _ERROR)),  # S3's 200 that carries an error: a 500
        (*CALLS[2][:2], (200, "<CompleteMultipartUploadResult")),  # cut short: a 500
        (*CALLS[2][:2], (404, _NO_UPLOAD)),
        (*CALLS[4][:2], (500, _ERROR)),
        (*CALLS[0][:2], (404, "")),
    ],
)
def test_errors_are_the_clients(serve, operation, send, answer):
    (ours, _, _), (theirs, _, _) = _both(serve, send, answer)
    assert ours == theirs
    assert ours[0] == "NoSuchUpload" or ours[1]["Code"] in ("InternalError", "500", "404")


def test_a_listing_is_decoded_as_the_client_decodes_it(serve):
    listed, _, _ = _one(serve, True, CALLS[4][1], (200, _LISTED))
    assert [item["Key"] for item in listed["Contents"]] == ["run a/x\ny&z"]
    assert [item["Prefix"] for item in listed["CommonPrefixes"]] == ["run a/sub?/"]
    assert listed["NextContinuationToken"] == "next+token"
    assert listed["Contents"][0]["LastModified"] == datetime.datetime(
        2026, 12, 4, 10, tzinfo=datetime.timezone.utc
    )


def test_a_redirect_hands_this_call_and_every_later_one_to_the_client(serve):
    server, heads = serve(
        lambda head: _answer(301, "") if b"s3ckpt/" in head else _answer(200, _CREATED)
    )
    config = _config(serve, server.port, True, None)
    for _ in range(2):
        created = _try(config, CALLS[0][1])
        assert created["UploadId"] == "up+/=1"
    assert [b"s3ckpt/" in head for head in heads] == [True, False, False]


@pytest.mark.parametrize(("operation", "send"), HANDED_OVER)
def test_what_the_data_plane_does_not_sign_the_client_sends(serve, operation, send):
    """The data plane hands each operation it does not sign to the client, chosen by the
    method called: the request the server gets is the client's."""
    server, heads = serve(lambda _: _answer(404, _NO_UPLOAD))
    with pytest.raises(ClientError) as failed:
        _try(_config(serve, server.port, True, None), send)
    assert failed.value.operation_name == operation
    assert len(heads) == 1 and b"aiobotocore" in heads[0] and b"s3ckpt/" not in heads[0]


# -- HEADs ----------------------------------------------------------------------------

_FOUND = (
    b'HTTP/1.1 200 OK\r\nETag: "etag-7"\r\nContent-Length: 1048576\r\n'
    b"Last-Modified: Fri, 04 Dec 2026 10:00:00 GMT\r\nExpires: not a date\r\n"
    b"Content-Type: application/octet-stream\r\n\r\n"
)  # a HEAD's answer: the object's length, no body
_MISSING = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
_REDIRECT = (
    b"HTTP/1.1 301 Moved Permanently\r\nx-amz-bucket-region: eu-west-1\r\nContent-Length: 0\r\n\r\n"
)


def _store(serve: ScriptedServers, port: int, **options: Any) -> ObjectStore:
    config = serve.client(
        S3Config(
            endpoint_url=f"http://127.0.0.1:{port}",
            access_key_id="AKIDHEADS",
            secret_access_key="heads-secret",
            region="eu-west-2",
            max_attempts=1,
            **options,
        )
    )
    return ObjectStore(config, "bucket")


def test_a_head_is_signed_and_its_answer_read_without_a_body(serve):
    server, heads = serve(lambda head: _FOUND)
    store = _store(serve, server.port, session_token="token-1")
    for _ in range(2):  # the kept-alive connection is sound after an answer with no body
        meta = io_loop().run(store.head("run/with space/obj.bin"))
        assert (meta.size, meta.etag) == (1048576, '"etag-7"')
        assert meta.last_modified == datetime.datetime(
            2026, 12, 4, 10, tzinfo=datetime.timezone.utc
        )
    assert len(heads) == 2
    line, *lines = heads[-1].decode("latin-1").split("\r\n")
    assert line == "HEAD /bucket/run/with%20space/obj.bin HTTP/1.1"
    fields = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in lines if h)}
    assert fields["user-agent"].startswith("s3ckpt/")
    assert fields["x-amz-security-token"] == "token-1"
    assert "/eu-west-2/s3/aws4_request" in fields["authorization"]
    assert io_loop().run(store.exists("run/obj.bin")) is True


@pytest.mark.parametrize("direct", [True, False])
def test_answers_are_the_clients(serve, direct):
    """Found, missing, a missing bucket: the same results on the data plane and through
    the client (``direct_uploads=False``)."""
    server, heads = serve(lambda head: _MISSING if b"missing" in head.split(b"\r\n")[0] else _FOUND)
    store = _store(serve, server.port, direct_uploads=direct)
    assert io_loop().run(store.exists("run/missing")) is False
    assert io_loop().run(store.exists("run/here")) is True
    io_loop().run(store.head_bucket())
    missing_bucket = ObjectStore(store.config, "missing-bucket")
    with pytest.raises(BucketNotFoundError):
        io_loop().run(missing_bucket.head_bucket())
    agent = b"s3ckpt/" if direct else b"aiobotocore"
    assert all(agent in head for head in heads)


def test_a_redirect_hands_this_head_and_every_later_one_to_the_client(serve):
    server, heads = serve(
        lambda head: _REDIRECT if head.startswith(b"HEAD") and b"s3ckpt/" in head else _FOUND
    )
    store = _store(serve, server.port)
    assert io_loop().run(store.head("run/obj")).etag == '"etag-7"'  # asked again, by the client
    assert io_loop().run(store.head("run/obj")).etag == '"etag-7"'
    assert [b"s3ckpt/" in head for head in heads] == [True, False, False]


@pytest.mark.parametrize("style", ["path", "virtual"])
def test_the_bucket_url_is_the_one_the_client_presigns(serve, style):
    config = serve.client(
        S3Config(
            endpoint_url="http://127.0.0.1:9",
            access_key_id="a",
            secret_access_key="b",
            region="us-east-1",
            addressing_style=style,
        )
    )

    async def both() -> tuple[Any, str]:
        handle = client_handle(config)
        client = await handle.get()
        transport = await handle.transport()
        assert isinstance(transport, DataPlane)
        uploads = transport.puts
        assert uploads is not None
        ours = await uploads.addresses.bucket("bkt")
        theirs = await client.generate_presigned_url(
            "head_bucket", Params={"Bucket": "bkt"}, ExpiresIn=60
        )
        await handle.aclose()
        return ours, theirs

    ours, theirs = io_loop().run(both())
    assert ours is not None
    assert ours[0].geturl() == urlsplit(theirs)._replace(query="").geturl()


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:9000/bucket/a%20b/c", "https://bucket.s3.example.com/", "http://h/b"]
)
def test_a_head_is_signed_as_botocore_signs_it(url):
    credentials = ReadOnlyCredentials("AKIDEXAMPLE", "secret", "token")
    config = Config(signature_version="s3v4", s3={"payload_signing_enabled": False})
    theirs = sign_s3(
        "HEAD", url, {}, credentials=credentials, region="us-east-1", service="s3",
        client_config=config,
    )  # fmt: skip
    moment = datetime.datetime.strptime(theirs["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(
        tzinfo=datetime.timezone.utc
    )
    ours = PartSigner().sign(
        urlsplit(url), {}, credentials=credentials, region="us-east-1", service="s3",
        now=moment, method="HEAD",
    )  # fmt: skip
    assert {k.lower(): v for k, v in ours.items()} == {k.lower(): v for k, v in theirs.items()}
