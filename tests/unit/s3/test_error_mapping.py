import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

from s3ckpt.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    EndpointError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
    TransientStorageError,
)
from s3ckpt.s3.error_mapping import translate


def _client_error(code, status=400):
    return ClientError(
        {"Error": {"Code": code, "Message": "msg"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "Op",
    )


@pytest.mark.parametrize(
    ("code", "key", "expected"),
    [
        ("NoSuchKey", "k", ObjectNotFoundError),
        ("404", "k", ObjectNotFoundError),
        ("404", None, BucketNotFoundError),
        ("NoSuchBucket", "k", BucketNotFoundError),
        ("InvalidAccessKeyId", "k", AccessDeniedError),
        ("SignatureDoesNotMatch", "k", AccessDeniedError),
        ("PreconditionFailed", "k", PreconditionFailedError),
        ("SlowDown", "k", TransientStorageError),
        ("NoSuchUpload", "k", StorageError),
    ],
)
def test_client_errors_map_to_the_hierarchy(code, key, expected):
    error = translate(_client_error(code), operation="PutObject", bucket="b", key=key)
    assert type(error) is expected
    assert error.code == code
    assert "PutObject" in str(error)


def test_not_found_is_a_file_not_found_error():
    assert isinstance(
        translate(_client_error("NoSuchKey"), operation="GetObject", bucket="b", key="k"),
        FileNotFoundError,
    )


def test_connection_and_credential_errors():
    assert isinstance(
        translate(
            EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), operation="PutObject"
        ),
        EndpointError,
    )
    error = translate(NoCredentialsError(), operation="PutObject", bucket="b", key="k")
    assert isinstance(error, AccessDeniedError)
    assert "credentials" in str(error)


def test_a_programming_error_inside_a_request_surfaces_unchanged(monkeypatch):
    """Only the store's and the network's failures become StorageError: a bug (here an
    AttributeError, as a library upgrade might cause) propagates as itself, not retried."""
    import asyncio

    from s3ckpt.config import S3Config
    from s3ckpt.s3.aiobotocore_transport import AiobotocoreTransport
    from s3ckpt.s3.store import ObjectStore

    calls: list[str] = []

    async def broken(self: AiobotocoreTransport, *args: object) -> object:
        calls.append("CopyObject")
        raise AttributeError("'AioBaseClient' object has no attribute 'get_object'")

    monkeypatch.setattr(AiobotocoreTransport, "copy_object", broken)
    config = S3Config(endpoint_url="http://127.0.0.1:9", access_key_id="a", secret_access_key="b")
    store = ObjectStore(config, "bucket")
    with pytest.raises(AttributeError, match="no attribute 'get_object'"):
        asyncio.run(store.copy("some/key", "bucket", "other/key"))
    assert calls == ["CopyObject"]  # tried once: a bug is not retried


def test_socket_and_protocol_errors_are_translated():
    import h11

    from s3ckpt.s3.error_mapping import translated

    for raised in (ConnectionResetError(), h11.RemoteProtocolError("bad"), TimeoutError()):
        with pytest.raises(StorageError), translated("GetObject", "b", "k"):
            raise raised
