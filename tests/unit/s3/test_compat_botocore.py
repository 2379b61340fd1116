"""The internals of botocore and aiobotocore that the S3 transport relies on are
still there and still behave as its compat modules say (``s3ckpt/s3/compat_*.py``): a
release that changes one fails here, by name, rather than somewhere in a save."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from botocore import exceptions as bce
from botocore.awsrequest import AWSResponse

from s3ckpt.config import make_config
from s3ckpt.s3 import compat_aiobotocore, compat_botocore, retry
from s3ckpt.s3.client import create_client

# -- botocore ---------------------------------------------------------------------------


def test_botocore_tls_defaults_and_ca_bundle() -> None:
    context = compat_botocore.default_tls_context()
    assert isinstance(context, ssl.SSLContext)
    assert context.protocol == ssl.PROTOCOL_TLS_CLIENT
    bundle = compat_botocore.ca_bundle(True)
    assert bundle is not None and Path(bundle).is_file()  # botocore's own bundle
    assert compat_botocore.ca_bundle("/etc/private-ca.pem") == "/etc/private-ca.pem"


def test_botocore_connection_errors_keep_their_endpoint_and_cause() -> None:
    endpoint, error = "https://s3.example:9000", OSError("refused")
    made = {
        compat_botocore.read_timeout(endpoint): bce.ReadTimeoutError,
        compat_botocore.connect_timeout(endpoint): bce.ConnectTimeoutError,
        compat_botocore.connection_failed(endpoint, error): bce.EndpointConnectionError,
        compat_botocore.tls_failed(endpoint, error): bce.SSLError,
    }
    for exc, cls in made.items():
        assert type(exc) is cls and endpoint in str(exc)
        assert retry.is_retryable(exc) is (cls is not bce.SSLError)
        assert compat_botocore.failed_endpoint(exc, "the endpoint") == endpoint
    assert compat_botocore.cause(compat_botocore.tls_failed(endpoint, error)) is error
    assert compat_botocore.cause(compat_botocore.connection_failed(endpoint, error)) is error
    assert compat_botocore.cause(compat_botocore.read_timeout(endpoint)) is None
    assert compat_botocore.failed_endpoint(bce.NoCredentialsError(), "the endpoint") == (
        "the endpoint"
    )


def _run(test: Callable[[Any], Awaitable[None]]) -> None:
    """``test(client)`` with an s3ckpt-configured client of an endpoint nothing serves:
    every request is answered by the hooks the test registers."""

    async def main() -> None:
        config = make_config(
            None,
            endpoint_url="http://127.0.0.1:9",
            access_key_id="key",
            secret_access_key="secret",
            region="us-east-1",
        )
        async with create_client(config) as client:
            await test(client)

    asyncio.run(main())


def test_botocore_hooks_and_aiobotocore_answers_from_a_handler() -> None:
    """A ``before-sign`` handler changes the request before it is signed; an async
    ``before-send`` handler sees the signed request and answers it: aiobotocore parses the
    response as one it had received (status, headers, an error document's code)."""
    seen: list[Any] = []
    body = memoryview(b"data")  # the data plane sends from the body botocore was given

    def before_sign(request: Any, **_: Any) -> None:
        request.headers["x-amz-meta-hooked"] = "yes"

    async def before_send(request: Any, **_: Any) -> Any:
        seen.append(request)
        await asyncio.sleep(0)  # a coroutine handler is awaited
        if request.url.endswith("/missing"):
            error = b"<Error><Code>NoSuchKey</Code><Message>gone</Message></Error>"
            return compat_aiobotocore.response(request.url, 404, {}, error)
        return compat_aiobotocore.response(request.url, 200, {"etag": '"e1"'}, b"")

    async def test(client: Any) -> None:
        compat_botocore.on_before_sign(client, "PutObject", before_sign)
        for operation in ("PutObject", "GetObject"):
            compat_botocore.on_before_send(client, operation, before_send)
        response = await client.put_object(Bucket="b", Key="k", Body=body)
        assert response["ETag"] == '"e1"'
        with pytest.raises(bce.ClientError) as failed:
            await client.get_object(Bucket="b", Key="missing")
        assert failed.value.response["Error"]["Code"] == "NoSuchKey"

    _run(test)
    put, get = seen
    assert (put.method, put.url) == ("PUT", "http://127.0.0.1:9/b/k")
    assert put.headers["x-amz-meta-hooked"] in (b"yes", "yes")  # the data plane takes either
    assert "x-amz-meta-hooked" in str(put.headers["Authorization"])  # signed after the hook
    assert put.body is body and get.method == "GET"


def test_botocore_serializer_and_the_handlers_of_a_saves_control_requests() -> None:
    """The serializer builds the query and body the client sends; the handlers turn a 200
    carrying an error into a 500, escape line breaks in a DeleteObjects body and decode an
    encoded listing."""

    async def test(client: Any) -> None:
        serialize = compat_botocore.serializer(client)
        create = compat_botocore.serialized(
            client, serialize, "CreateMultipartUpload",
            {"Bucket": "b", "Key": "k", "ChecksumAlgorithm": "CRC32C"},
        )  # fmt: skip
        assert (create.method, create.query, create.body) == ("POST", "uploads", b"")
        assert create.headers == {"x-amz-checksum-algorithm": "CRC32C"}
        listing = compat_botocore.serialized(
            client, serialize, "ListObjectsV2",
            {"Bucket": "b", "Prefix": "a b/", "EncodingType": "url"},
        )  # fmt: skip
        assert (listing.method, listing.query) == (
            "GET", "list-type=2&prefix=a%20b%2F&encoding-type=url"
        )  # fmt: skip
        operation = "CompleteMultipartUpload"
        error = b"<Error><Code>InternalError</Code><Message>m</Message></Error>"
        assert compat_botocore.answer_status(client, operation, 200, error) == 500
        assert compat_botocore.answer_status(client, operation, 200, b"<Complete") == 500
        assert compat_botocore.answer_status(client, operation, 200, b"<Done/>") == 200
        assert compat_botocore.answer_status(client, operation, 404, error) == 404

    _run(test)
    assert compat_botocore.escaped_xml(b"<Key>a\r\nb</Key>") == b"<Key>a&#xD;&#xA;b</Key>"
    parsed = {"EncodingType": "url", "Prefix": "a%20b/", "Contents": [{"Key": "a%20b/%0A"}]}
    decoded = compat_botocore.decoded_listing(parsed)
    assert (decoded["Prefix"], decoded["Contents"][0]["Key"]) == ("a b/", "a b/\n")


def test_aiobotocore_response_reads_its_body_as_aiobotocore_does() -> None:
    answer = compat_aiobotocore.response("https://h/b/k", 200, {"etag": '"x"'}, b"body")
    assert isinstance(answer, AWSResponse) and isinstance(answer, compat_aiobotocore.Response)
    assert (answer.status_code, answer.headers["etag"]) == (200, '"x"')
    assert asyncio.run(_awaited(answer.content)) == b"body"


async def _awaited(value: Awaitable[bytes]) -> bytes:
    return await value


# -- a local HTTP server for aiohttp and aiobotocore's streamed bodies ----------------------


async def _serve(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Any:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


def test_aiobotocore_streamed_bodies_sit_on_aiohttps_stream_reader() -> None:
    data = bytes(range(256)) * 1024

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=data, content_type="application/octet-stream")

    async def main() -> None:
        runner, url = await _serve(handler)
        try:
            config = make_config(
                None,
                endpoint_url=url,
                access_key_id="key",
                secret_access_key="secret",
                region="us-east-1",
            )
            async with create_client(config) as client:
                response = await client.get_object(Bucket="b", Key="k")
                async with response["Body"] as body:
                    content = compat_aiobotocore.received_chunks(body)
                    assert isinstance(content, aiohttp.StreamReader)
                    received = bytearray()
                    while chunk := (await content.readchunk())[0]:
                        received += chunk
                assert received == data
        finally:
            await runner.cleanup()

    asyncio.run(main())
