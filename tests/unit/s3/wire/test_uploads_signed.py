"""Part uploads built and signed on the data plane (``s3ckpt.s3.wire.uploads.SignedPuts``)
against a scripted server on loopback: what is sent, that an error answer becomes the
exception the client's own path raises, and that a redirect hands parts to the client.
Real signatures are checked by SeaweedFS in tests/integration/test_signed_parts.py."""

from __future__ import annotations

from typing import Any

import pytest
from scripted_servers import ScriptedServers

from s3ckpt.config import S3Config
from s3ckpt.errors import StorageError
from s3ckpt.s3.client import client_handle
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.s3.wire import DataPlane
from s3ckpt.s3.wire.uploads import SignedPuts, put_headers

_OK = b'HTTP/1.1 200 OK\r\nETag: "etag-1"\r\nContent-Length: 0\r\n\r\n'
_NO_SUCH_UPLOAD = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchUpload</Code>'
    b"<Message>The specified upload does not exist.</Message>"
    b"<RequestId>r-1</RequestId></Error>"
)
_REDIRECT = (
    b"<Error><Code>PermanentRedirect</Code><Message>Use the other endpoint.</Message>"
    b"<Endpoint>elsewhere.example.com</Endpoint></Error>"
)


def _answer(status: str, body: bytes = b"", *, close: bool = False) -> bytes:
    connection = "Connection: close\r\n" if close else ""
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n{connection}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def _config(serve: ScriptedServers, port: int, **options: Any) -> S3Config:
    return serve.client(_made(port, **options))


def _made(port: int, **options: Any) -> S3Config:
    return S3Config(
        endpoint_url=f"http://127.0.0.1:{port}",
        access_key_id="AKIDPARTS",
        secret_access_key="parts-secret",
        region="eu-west-2",
        max_attempts=1,
        **options,
    )


def _upload(config: S3Config, key: str = "run/data/obj", upload_id: str = "up+id/1=") -> Any:
    store = ObjectStore(config, "bucket")
    return io_loop().run(store.upload_part(key, upload_id, 3, memoryview(b"x" * 1000), 12345))


def _fields(head: bytes) -> tuple[str, dict[str, str]]:
    line, *rest = head.decode("latin-1").split("\r\n")
    return line, {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in rest if h)}


def test_a_part_is_built_and_signed_on_the_data_plane(serve):
    server, heads = serve(lambda head: _OK)
    config = _config(serve, server.port, session_token="session-token-1")
    part = _upload(config)
    assert part.etag == '"etag-1"' and part.part_number == 3
    line, headers = _fields(heads[-1])
    # the object addressed as the client addresses it (path style), the query encoded as signed
    assert line == "PUT /bucket/run/data/obj?partNumber=3&uploadId=up%2Bid%2F1%3D HTTP/1.1"
    assert headers["content-length"] == "1000"
    assert headers["x-amz-checksum-crc32c"] == "AAAwOQ=="
    assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
    assert headers["x-amz-security-token"] == "session-token-1"
    assert headers["user-agent"].startswith("s3ckpt/")  # not the client's
    authorization = headers["authorization"]
    assert authorization.startswith("AWS4-HMAC-SHA256 Credential=AKIDPARTS/")
    assert "/eu-west-2/s3/aws4_request" in authorization
    signed = authorization.split("SignedHeaders=")[1].split(",")[0].split(";")
    assert {"host", "x-amz-checksum-crc32c", "x-amz-content-sha256", "x-amz-date"} <= set(signed)
    assert "x-amz-security-token" in signed
    assert "parts-secret" not in heads[-1].decode("latin-1")


def test_an_error_answer_is_the_error_the_client_raises(serve):
    """The same answer, once to a part on the data plane and once through the client
    (``direct_uploads=False``): the same s3ckpt error, code and message."""
    answers = {
        "NoSuchUpload": lambda head: _answer("404 Not Found", _NO_SUCH_UPLOAD),
        "503": lambda head: _answer("503 Service Unavailable"),
    }
    for code, answer in answers.items():
        server, heads = serve(answer)
        errors = []
        for direct in (True, False):
            with pytest.raises(StorageError) as caught:
                _upload(_config(serve, server.port, direct_uploads=direct))
            errors.append(caught.value)
        ours, clients = errors
        assert b"s3ckpt/" in heads[0] and b"aiobotocore" in heads[1]
        assert type(ours) is type(clients) and ours.code == clients.code == code
        assert str(ours) == str(clients)


def _redirect_data_plane_puts(head: bytes) -> bytes:
    """A redirect for the PUTs the data plane sends, success for the client's."""
    if head.startswith(b"PUT") and b"s3ckpt/" in head:
        return _answer("301 Moved Permanently", _REDIRECT)
    return _OK


def test_a_redirect_hands_this_part_and_every_later_one_to_the_client(serve):
    server, heads = serve(_redirect_data_plane_puts)
    config = _config(serve, server.port)
    with pytest.raises(StorageError) as caught:
        _upload(config)
    assert caught.value.code == "PermanentRedirect"

    async def parts() -> SignedPuts | None:
        transport = await client_handle(config).transport()
        assert isinstance(transport, DataPlane)
        return transport.puts

    assert io_loop().run(parts()) is None
    assert _upload(config).etag == '"etag-1"'
    assert b"aiobotocore" in heads[-1] and b"s3ckpt/" not in heads[-1]


def test_the_object_is_addressed_and_scoped_as_the_presigned_url_says():
    """Virtual-hosted addressing and the signing region come from the client's presigned
    URL: the bucket in the host, the scope's region and service."""

    class Client:
        async def generate_presigned_url(self, method: str, Params: Any, ExpiresIn: int) -> str:
            assert method == "put_object"
            return (
                f"https://{Params['Bucket']}.s3.example.com/{Params['Key']}?X-Amz-Algorithm="
                "AWS4-HMAC-SHA256&X-Amz-Credential=AKID%2F20260101%2Fus-west-1%2Fs3%2F"
                "aws4_request&X-Amz-Signature=abc"
            )

    parts = SignedPuts(Client(), transport=None)  # type: ignore[arg-type]  # never reached
    found = io_loop().run(parts.addresses.presigned("bkt", "a/b"))
    assert (found[0].geturl(), *found[1:]) == ("https://bkt.s3.example.com/a/b", "us-west-1", "s3")


_KEYS = [
    "run/step-1/manifest.json",
    "with space/and+plus=eq&amp?q#h/ünïcödé.bin",
    "a~b_c-d.e/(1)[2]!*'$,;:@.json",
    "/leading//double/./dots/../x",
    "percent%20already",
]


@pytest.mark.parametrize("style", ["path", "virtual"])
def test_a_derived_url_is_the_one_the_client_presigns(serve, style):
    """The object URLs derived from the bucket's one presigned URL are the URLs the
    client presigns for each key: path and host, quoting included."""
    config = _config(serve, 9, addressing_style=style)  # never connected to: presigning is local

    async def both() -> list[tuple[Any, Any]]:
        transport = await client_handle(config).transport()
        assert isinstance(transport, DataPlane)
        uploads = transport.puts
        assert uploads is not None
        return [
            (
                await uploads.addresses.derived("bucket", key),
                await uploads.addresses.presigned("bucket", key),
            )
            for key in _KEYS
        ]

    for derived, presigned in io_loop().run(both()):
        assert (derived[0].geturl(), *derived[1:]) == (presigned[0].geturl(), *presigned[1:])


def test_a_whole_object_is_put_on_the_data_plane(serve):
    server, heads = serve(lambda head: _OK)
    config = _config(serve, server.port)
    store = ObjectStore(config, "bucket")
    body = b'{"step": 1}'
    key = "run/with space/manifest.json"
    etag = io_loop().run(
        store.put(key, body, mode="create", crc32c=12345, content_type="application/json")
    )
    assert etag == '"etag-1"'
    line, headers = _fields(heads[-1])
    assert line == "PUT /bucket/run/with%20space/manifest.json HTTP/1.1"
    assert headers["content-length"] == str(len(body))
    assert headers["if-none-match"] == "*"
    assert headers["content-type"] == "application/json"
    assert headers["x-amz-checksum-crc32c"] == "AAAwOQ=="
    assert headers["user-agent"].startswith("s3ckpt/")
    signed = headers["authorization"].split("SignedHeaders=")[1].split(",")[0].split(";")
    assert signed == [
        "content-type", "host", "if-none-match", "x-amz-checksum-crc32c",
        "x-amz-content-sha256", "x-amz-date",
    ]  # fmt: skip


def test_a_taken_key_and_a_server_error_are_the_errors_the_client_raises(serve):
    """A create refused (412; the key then read back, and gone again) and a 503, once on
    the data plane and once through the client: the same s3ckpt error."""
    taken = (
        b"<Error><Code>PreconditionFailed</Code><Message>At least one of the pre-conditions"
        b" you specified did not hold</Message><Condition>If-None-Match</Condition></Error>"
    )
    gone = _answer("404 Not Found", b"<Error><Code>NoSuchKey</Code><Message>No</Message></Error>")
    answers = {
        "PreconditionFailed": lambda head: (
            _answer("412 Precondition Failed", taken) if head.startswith(b"PUT") else gone
        ),
        "503": lambda head: _answer("503 Service Unavailable"),
    }
    for code, answer in answers.items():
        server, heads = serve(answer)
        errors = []
        for direct in (True, False):
            store = ObjectStore(_config(serve, server.port, direct_uploads=direct), "bucket")
            with pytest.raises(StorageError) as caught:
                io_loop().run(store.put("run/manifest.json", b"mine", mode="create"))
            errors.append(caught.value)
        puts = [head for head in heads if head.startswith(b"PUT")]
        assert b"s3ckpt/" in puts[0] and b"aiobotocore" in puts[1]
        ours, clients = errors
        assert type(ours) is type(clients) and ours.code == clients.code == code
        assert str(ours) == str(clients)


def test_put_headers_send_only_what_the_data_plane_knows():
    body = memoryview(b"x")
    assert put_headers({"Key": "k", "Body": body}) == {}
    assert put_headers(
        {"Key": "k", "Body": body, "IfNoneMatch": "*", "ChecksumCRC32C": "AAAAew==",
         "ContentType": "application/json"}
    ) == {
        "If-None-Match": "*", "x-amz-checksum-crc32c": "AAAAew==",
        "Content-Type": "application/json",
    }  # fmt: skip
    assert put_headers({"Key": "k", "Body": body, "Metadata": {"a": "b"}}) is None


def test_a_redirected_put_is_sent_again_by_the_client_and_so_is_every_later_one(serve):
    server, heads = serve(_redirect_data_plane_puts)
    store = ObjectStore(_config(serve, server.port), "bucket")
    for _ in range(2):
        assert io_loop().run(store.put("run/manifest.json", b"{}", mode="create")) == '"etag-1"'
    assert [b"s3ckpt/" in head for head in heads] == [True, False, False]
