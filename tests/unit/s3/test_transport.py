"""The transport seam (``s3ckpt.s3.transport``): which transport a client gets, chosen once
as it is made, and the data plane's one switch to the client after a redirect."""

from __future__ import annotations

from typing import Any

import pytest
from scripted_servers import ScriptedServers

from s3ckpt.config import S3Config
from s3ckpt.s3.aiobotocore_transport import AiobotocoreTransport
from s3ckpt.s3.client import client_handle
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.s3.transport import Transport
from s3ckpt.s3.wire import DataPlane

_OK = b'HTTP/1.1 200 OK\r\nETag: "etag-1"\r\nContent-Length: 0\r\n\r\n'
_MOVED = b"HTTP/1.1 301 Moved Permanently\r\nContent-Length: 0\r\n\r\n"
_CREATED = (
    b"<InitiateMultipartUploadResult><Bucket>bucket</Bucket><Key>k</Key>"
    b"<UploadId>up-1</UploadId></InitiateMultipartUploadResult>"
)


def _config(serve: ScriptedServers, port: int, **options: Any) -> S3Config:
    return serve.client(
        S3Config(
            endpoint_url=f"http://127.0.0.1:{port}",
            access_key_id="AKIDSEAM",
            secret_access_key="seam-secret",
            region="eu-west-2",
            max_attempts=1,
            **options,
        )
    )


def _transports(config: S3Config) -> tuple[Transport, Transport]:
    """The transport of ``config``'s client, asked for twice."""

    async def both() -> tuple[Transport, Transport]:
        handle = client_handle(config)
        return await handle.transport(), await handle.transport()

    return io_loop().run(both())


@pytest.mark.parametrize(
    ("options", "kind"),
    [
        ({}, DataPlane),
        ({"direct_uploads": False}, DataPlane),  # ranged GETs still on the data plane
        ({"direct_reads": False}, DataPlane),
        ({"direct_uploads": False, "direct_reads": False}, AiobotocoreTransport),
        ({"proxies": {"http": "http://127.0.0.1:9"}}, AiobotocoreTransport),
    ],
)
def test_a_client_gets_one_transport_chosen_as_it_is_made(serve, options, kind):
    first, again = _transports(_config(serve, 9, **options))  # never connected to
    assert type(first) is kind
    assert again is first


def test_what_the_data_plane_does_not_send_goes_through_the_client(serve):
    first, _ = _transports(_config(serve, 9, direct_uploads=False))
    assert isinstance(first, DataPlane)
    assert first.puts is None and first.calls is None and first.gets is not None
    assert isinstance(first.client_transport, AiobotocoreTransport)
    assert not first.sends_batches()


def _redirect_ours(head: bytes) -> bytes:
    """A redirect for what the data plane sends, its answer for what the client sends."""
    if b"s3ckpt/" in head:
        return _MOVED
    if head.startswith(b"POST"):
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(_CREATED) + _CREATED
    return _OK


def test_one_redirect_sends_every_later_request_through_the_client(serve):
    """A PutObject redirected on the data plane is sent again by the client, and so is
    every later request of every kind: one switch, not one per kind of request."""
    server, heads = serve(_redirect_ours)
    config = _config(serve, server.port)
    store = ObjectStore(config, "bucket")
    assert io_loop().run(store.put("run/marker", b"m")) == '"etag-1"'
    assert [b"s3ckpt/" in head for head in heads] == [True, False]
    assert io_loop().run(store.create_multipart("run/obj")) == "up-1"
    part = io_loop().run(store.upload_part("run/obj", "up-1", 1, b"x" * 100, None))
    assert part.etag == '"etag-1"'
    assert [b"s3ckpt/" in head for head in heads] == [True, False, False, False]
    transport, _ = _transports(config)
    assert isinstance(transport, DataPlane)
    assert transport.puts is None and transport.calls is None and not transport.sends_batches()


class _RecordingClient:
    """An aiobotocore client that records each method called and its parameters."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, method: str) -> Any:
        async def send(**params: Any) -> dict[str, Any]:
            self.sent.append((method, params))
            return {}

        return send


_PARTS = [{"PartNumber": 1, "ETag": '"e-1"'}]


@pytest.mark.parametrize(
    ("call", "method", "params"),
    [
        (lambda t: t.head_object("b", "k"), "head_object", {"Key": "k"}),
        (lambda t: t.head_bucket("b"), "head_bucket", {}),
        (
            lambda t: t.create_multipart_upload("b", "k", checksum=True),
            "create_multipart_upload",
            {"Key": "k", "ChecksumAlgorithm": "CRC32C"},
        ),
        (
            lambda t: t.create_multipart_upload("b", "k", checksum=False),
            "create_multipart_upload",
            {"Key": "k"},
        ),
        (
            lambda t: t.complete_multipart_upload("b", "k", "u", _PARTS, create=True),
            "complete_multipart_upload",
            {"Key": "k", "UploadId": "u", "MultipartUpload": {"Parts": _PARTS}, "IfNoneMatch": "*"},
        ),
        (
            lambda t: t.abort_multipart_upload("b", "k", "u"),
            "abort_multipart_upload",
            {"Key": "k", "UploadId": "u"},
        ),
        (
            lambda t: t.list_objects("b", "p/", delimiter="/", start_after="p/a"),
            "list_objects_v2",
            {"Prefix": "p/", "Delimiter": "/", "StartAfter": "p/a"},
        ),
        (
            lambda t: t.list_objects("b", "p/", continuation_token="t"),
            "list_objects_v2",
            {"Prefix": "p/", "ContinuationToken": "t"},
        ),
        (
            lambda t: t.list_multipart_uploads("b", "p/", key_marker="p/x", upload_id_marker=""),
            "list_multipart_uploads",
            {"Prefix": "p/", "KeyMarker": "p/x", "UploadIdMarker": ""},
        ),
        (
            lambda t: t.list_object_versions("b", "p/", key_marker="p/x", version_id_marker="v"),
            "list_object_versions",
            {"Prefix": "p/", "KeyMarker": "p/x", "VersionIdMarker": "v"},
        ),
        (
            lambda t: t.copy_object("b", "k", "src", "s/k"),
            "copy_object",
            {"Key": "k", "CopySource": {"Bucket": "src", "Key": "s/k"}},
        ),
        (
            lambda t: t.upload_part_copy("b", "k", "u", 2, ("src", "s/k", 10, 20)),
            "upload_part_copy",
            {
                "Key": "k",
                "UploadId": "u",
                "PartNumber": 2,
                "CopySource": {"Bucket": "src", "Key": "s/k"},
                "CopySourceRange": "bytes=10-19",
            },
        ),
        (
            lambda t: t.delete_object("b", "k", if_match='"e"'),
            "delete_object",
            {"Key": "k", "IfMatch": '"e"'},
        ),
        (
            lambda t: t.delete_objects("b", [{"Key": "k", "VersionId": "v"}]),
            "delete_objects",
            {"Delete": {"Objects": [{"Key": "k", "VersionId": "v"}], "Quiet": True}},
        ),
        (lambda t: t.get_bucket_versioning("b"), "get_bucket_versioning", {}),
        (
            lambda t: t.get_bucket_lifecycle_configuration("b"),
            "get_bucket_lifecycle_configuration",
            {},
        ),
    ],
)
def test_each_operation_is_the_clients_method_with_its_parameters(call, method, params):
    """Through the client, each method of the seam calls the client's method for its
    operation with the parameters the caller would pass it by hand."""
    client = _RecordingClient()
    io_loop().run(call(AiobotocoreTransport(client, "the endpoint")))
    assert client.sent == [(method, {"Bucket": "b", **params})]
