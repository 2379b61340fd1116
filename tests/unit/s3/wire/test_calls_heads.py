"""HEADs built, signed and answered on the data plane (``s3ckpt.s3.wire.calls``) against a
scripted server on loopback: what is sent, that a HEAD's answer (a ``Content-Length``
and no body) is read whole, that an answer is what the client's own path returns or
raises, and that a redirect hands HEADs to the client. Real signatures are checked by
SeaweedFS in tests/integration/test_signed_parts.py."""

from __future__ import annotations

import datetime
from typing import Any
from urllib.parse import urlsplit

import pytest
from botocore.config import Config
from botocore.credentials import ReadOnlyCredentials
from scripted_servers import ScriptedServers

from s3ckpt.config import S3Config
from s3ckpt.errors import BucketNotFoundError
from s3ckpt.s3.client import client_handle
from s3ckpt.s3.compat_botocore import sign_s3
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.s3.wire import DataPlane
from s3ckpt.s3.wire.signing import PartSigner

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
