"""Part uploads and whole-object PUTs signed on the data plane, against real servers
(SeaweedFS checks every SigV4 signature against its identities and every CRC32C): they land
byte-exact without the client sending them, and a refused one is the error the client's
own path gets."""

from __future__ import annotations

from typing import Any

import pytest
from s3_servers import ON_BOTH

from s3ckpt.config import S3URI, make_config
from s3ckpt.errors import StorageError
from s3ckpt.format.checksums import crc_of
from s3ckpt.s3.client import client_handle
from s3ckpt.s3.compat_botocore import on_before_send
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.multipart import PartResult
from s3ckpt.s3.store import ObjectStore

MiB = 1024 * 1024


def _store(local_s3: Any, s3_options: dict[str, Any], **overrides: Any) -> ObjectStore:
    return ObjectStore(make_config(None, **{**s3_options, **overrides}), local_s3.bucket)


def _refusals(local_s3, s3_options, key: str, upload_id: str | None, **overrides) -> list:
    """The error of one refused part, sent on the data plane and then by the client."""
    loop = io_loop()
    errors = []
    for direct in (True, False):
        store = _store(local_s3, s3_options, direct_uploads=direct, max_attempts=1, **overrides)
        owner = _store(local_s3, s3_options)
        upload = upload_id or loop.run(owner.create_multipart(key))
        try:
            with pytest.raises(StorageError) as caught:
                loop.run(store.upload_part(key, upload, 1, memoryview(b"x" * MiB), 12345))
        finally:
            if upload_id is None:
                loop.run(owner.abort_multipart(key, upload))
        errors.append(caught.value)
    return errors


@ON_BOTH
def test_parts_land_byte_exact_without_the_client_sending_them(local_s3, s3_prefix, s3_options):
    store = _store(local_s3, s3_options)
    key = S3URI.parse(s3_prefix).key("data/signed.bin")
    pieces = [bytes([n]) * (5 * MiB) for n in (1, 2)] + [b"tail" * 1000]
    sent_by_client: list[str] = []

    async def upload() -> None:
        client = await client_handle(store.requests.config).get()
        on_before_send(client, "UploadPart", lambda **_: sent_by_client.append("part"))
        upload_id = await store.create_multipart(key)
        parts: list[PartResult] = []
        for number, piece in enumerate(pieces, start=1):
            body = memoryview(piece)
            parts.append(await store.upload_part(key, upload_id, number, body, crc_of(body)))
        await store.complete_multipart(key, upload_id, parts)

    io_loop().run(upload())
    assert sent_by_client == []
    body = local_s3.client().get_object(Bucket=local_s3.bucket, Key=key)["Body"].read()
    assert body == b"".join(pieces)


@ON_BOTH
def test_a_part_of_an_unknown_upload_is_refused_as_through_the_client(
    local_s3, s3_prefix, s3_options
):
    key = S3URI.parse(s3_prefix).key("data/unknown.bin")
    ours, clients = _refusals(local_s3, s3_options, key, "no-such-upload")
    assert type(ours) is type(clients) and ours.code == clients.code


def test_a_part_whose_checksum_is_wrong_is_refused_as_through_the_client(
    local_s3, s3_prefix, s3_options
):
    """SeaweedFS checks part checksums (moto does not: docs/compatibility.md)."""
    key = S3URI.parse(s3_prefix).key("data/bad-checksum.bin")
    ours, clients = _refusals(local_s3, s3_options, key, None)
    assert type(ours) is type(clients) and ours.code == clients.code == "BadDigest"


def test_a_wrong_secret_is_refused_as_through_the_client(local_s3, s3_prefix, s3_options):
    """SeaweedFS checks signatures (moto's server takes any)."""
    key = S3URI.parse(s3_prefix).key("data/forged.bin")
    loop = io_loop()
    owner = _store(local_s3, s3_options)
    upload_id = loop.run(owner.create_multipart(key))
    try:
        ours, clients = _refusals(
            local_s3, s3_options, key, upload_id, secret_access_key="not-the-secret"
        )
    finally:
        loop.run(owner.abort_multipart(key, upload_id))
    assert type(ours) is type(clients) and ours.code == clients.code == "SignatureDoesNotMatch"
    assert "not-the-secret" not in str(ours)


@ON_BOTH
def test_whole_objects_land_without_the_client_sending_them(local_s3, s3_prefix, s3_options):
    """PutObject as a save sends it (a CRC32C, a content type, a create that must not
    replace), keys that need quoting included: stored byte-exact, and a second create
    of a key is refused as through the client."""
    store = _store(local_s3, s3_options)
    location = S3URI.parse(s3_prefix)
    sent_by_client: list[str] = []
    bodies = {
        location.key("manifest.json"): b'{"step": 1}',
        location.key("with space/ünï+x=y.json"): b"\x00" * 70_000,
    }

    async def put_all() -> None:
        client = await client_handle(store.requests.config).get()
        on_before_send(client, "PutObject", lambda **_: sent_by_client.append("put"))
        for key, body in bodies.items():
            await store.put(
                key, body, mode="create", crc32c=crc_of(memoryview(body)),
                content_type="application/json",
            )  # fmt: skip

    io_loop().run(put_all())
    assert sent_by_client == []
    for key, body in bodies.items():
        stored = local_s3.client().get_object(Bucket=local_s3.bucket, Key=key)
        assert stored["Body"].read() == body
        assert stored["ContentType"] == "application/json"


@ON_BOTH
def test_a_create_of_a_taken_key_is_refused_as_through_the_client(local_s3, s3_prefix, s3_options):
    key = S3URI.parse(s3_prefix).key("manifest.json")
    io_loop().run(_store(local_s3, s3_options).put(key, b"first"))
    errors = []
    for direct in (True, False):
        store = _store(local_s3, s3_options, direct_uploads=direct, max_attempts=1)
        with pytest.raises(StorageError) as caught:
            io_loop().run(store.put(key, b"second", mode="create"))
        errors.append(caught.value)
    ours, clients = errors
    assert type(ours) is type(clients) and ours.code == clients.code


@ON_BOTH
def test_heads_are_answered_without_the_client_sending_them(local_s3, s3_prefix, s3_options):
    """HeadObject and HeadBucket on the data plane: what the client would return, for a
    key there and one missing, and the bucket; a missing bucket is the client's error."""
    key = S3URI.parse(s3_prefix).key("with space/ünï.json")
    local_s3.client().put_object(Bucket=local_s3.bucket, Key=key, Body=b"12345")
    sent_by_client: list[str] = []
    store = _store(local_s3, s3_options)

    async def ask() -> tuple[Any, bool, bool]:
        client = await client_handle(store.requests.config).get()
        for operation in ("HeadObject", "HeadBucket"):
            on_before_send(client, operation, lambda op=operation, **_: sent_by_client.append(op))
        await store.head_bucket()
        return await store.head(key), await store.exists(key), await store.exists(key + "x")

    meta, there, missing = io_loop().run(ask())
    assert sent_by_client == []
    theirs = local_s3.client().head_object(Bucket=local_s3.bucket, Key=key)
    assert (meta.size, meta.etag, meta.last_modified) == (
        5, theirs["ETag"], theirs["LastModified"],
    )  # fmt: skip
    assert (there, missing) == (True, False)
    errors = []
    for direct in (True, False):
        config = make_config(None, **{**s3_options, "direct_uploads": direct, "max_attempts": 1})
        with pytest.raises(StorageError) as caught:
            io_loop().run(ObjectStore(config, "no-such-bucket-s3ckpt").head_bucket())
        errors.append(caught.value)
    ours, clients = errors
    assert type(ours) is type(clients) and ours.code == clients.code
