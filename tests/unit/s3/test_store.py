"""The store: its listings against servers that paginate oddly (and the listing of open
multipart uploads it has from :mod:`s3ckpt.s3.multipart`), the error class of a retryable
status that outlived its retries, its client's rotation and DeleteObjects' Content-MD5."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from botocore.exceptions import ClientError

from s3ckpt.config import make_config
from s3ckpt.errors import StorageError, TransientStorageError
from s3ckpt.s3 import operations
from s3ckpt.s3.error_mapping import translate
from s3ckpt.s3.store import ObjectStore


def _store(pages: list[dict[str, Any]], seen: list[dict[str, Any]]) -> ObjectStore:
    store = ObjectStore(make_config(None, endpoint_url="http://127.0.0.1:9"), "bucket")

    async def list_objects(prefix: str, **page: Any) -> dict[str, Any]:
        seen.append(operations.list_objects(prefix, **page))  # the request's parameters
        if len(seen) > 10:
            raise AssertionError("the listing did not end")
        return pages[min(len(seen), len(pages)) - 1]

    store.requests.list_objects = list_objects  # type: ignore[method-assign]
    return store


def _keys(store: ObjectStore, prefix: str = "p/") -> list[str]:
    async def collect() -> list[str]:
        return [m.key async for m in store.list(prefix)]

    return asyncio.run(collect())


def _page(*keys: str, truncated: bool, token: str | None = None) -> dict[str, Any]:
    page: dict[str, Any] = {
        "Contents": [{"Key": k, "Size": 1} for k in keys],
        "IsTruncated": truncated,
    }
    if token:
        page["NextContinuationToken"] = token
    return page


def test_a_truncated_page_without_a_token_continues_after_its_last_key() -> None:
    seen: list[dict[str, Any]] = []
    store = _store([_page("p/a", "p/b", truncated=True), _page("p/c", truncated=False)], seen)
    assert _keys(store) == ["p/a", "p/b", "p/c"]
    assert seen[1] == {"Prefix": "p/", "StartAfter": "p/b"}


def test_an_empty_truncated_page_without_a_token_is_an_error_not_a_loop() -> None:
    store = _store([_page(truncated=True)], [])
    with pytest.raises(StorageError, match="truncated"):
        _keys(store)


def test_continuation_tokens_are_followed() -> None:
    seen: list[dict[str, Any]] = []
    pages = [_page("p/a", truncated=True, token="t1"), _page("p/b", truncated=False)]
    assert _keys(_store(pages, seen)) == ["p/a", "p/b"]
    assert seen[1] == {"Prefix": "p/", "ContinuationToken": "t1"}


def test_a_multipart_listing_that_repeats_its_marker_is_an_error() -> None:
    store = ObjectStore(make_config(None, endpoint_url="http://127.0.0.1:9"), "bucket")
    page = {
        "Uploads": [{"Key": "p/x", "UploadId": "u1"}],
        "IsTruncated": True,
        "NextKeyMarker": "p/x",
        "NextUploadIdMarker": "u1",
    }

    async def list_multipart_uploads(prefix: str, **markers: Any) -> dict[str, Any]:
        return page

    store.requests.list_multipart_uploads = list_multipart_uploads  # type: ignore[method-assign]

    async def collect() -> list[str]:
        return [u.upload_id async for u in store.list_multipart_uploads("p/")]

    with pytest.raises(StorageError, match="truncated"):
        asyncio.run(collect())


@pytest.mark.parametrize("status", [502, 504, 500, 503])
def test_a_retryable_status_that_outlived_its_retries_is_transient(status: int) -> None:
    error = ClientError(
        {
            "Error": {"Code": str(status), "Message": ""},
            "ResponseMetadata": {"HTTPStatusCode": status},
        },
        "PutObject",
    )
    assert isinstance(
        translate(error, operation="PutObject", bucket="b", key="k"), TransientStorageError
    )


def test_a_refusal_is_not_transient() -> None:
    error = ClientError(
        {
            "Error": {"Code": "InvalidArgument", "Message": "no"},
            "ResponseMetadata": {"HTTPStatusCode": 400},
        },
        "PutObject",
    )
    translated = translate(error, operation="PutObject", bucket="b", key="k")
    assert type(translated) is StorageError


def test_rotated_credentials_replace_the_client_and_close_the_old_one(monkeypatch) -> None:
    from s3ckpt.s3 import client as client_module
    from s3ckpt.s3.loop import io_loop

    closed: list[object] = []

    async def record(self: client_module.ClientHandle) -> None:
        closed.append(self)

    monkeypatch.setattr(client_module.ClientHandle, "aclose", record)
    monkeypatch.setattr(client_module, "RETIRE_AFTER_READ_TIMEOUTS", 0)
    config = make_config(None, endpoint_url="http://127.0.0.1:9", connect_timeout=0.01)

    async def rotate() -> list[object]:
        handles = []
        for token in ("one", "two", "three"):
            monkeypatch.setenv("AWS_SESSION_TOKEN", token)
            handles.append(client_module.client_handle(config))
            handles.append(client_module.client_handle(config))  # the same while unchanged
        await asyncio.sleep(0.2)
        return handles

    handles = io_loop().run(rotate())
    assert handles[0] is handles[1] and handles[2] is handles[3] and handles[0] is not handles[2]
    assert closed == [handles[0], handles[2]]  # the replaced ones, not the current one
    live = [k for k in io_loop().resources if k[0] == "s3-client" and k[1] == config.client_key()]
    assert len(live) == 1


def test_delete_objects_carries_a_content_md5() -> None:
    import base64
    import hashlib

    from botocore.awsrequest import AWSRequest

    from s3ckpt.s3.client import add_content_md5

    body = b"<Delete><Object><Key>k</Key></Object><Quiet>true</Quiet></Delete>"
    request = AWSRequest(method="POST", url="http://127.0.0.1:9/b?delete", data=body)
    add_content_md5(request)
    expected = base64.b64encode(hashlib.md5(body).digest()).decode()
    assert request.headers["Content-MD5"] == expected


def test_a_level_listing_without_tokens_continues_past_its_last_folder() -> None:
    """With a delimiter a page may end on a folder: the next page must start after every key
    in it, or the same folder would come back forever."""
    seen: list[dict[str, Any]] = []
    first = _page("p/a.json", truncated=True)
    first["CommonPrefixes"] = [{"Prefix": "p/step-1/"}]
    second = _page(truncated=False)
    second["CommonPrefixes"] = [{"Prefix": "p/step-1/"}, {"Prefix": "p/step-2/"}]
    store = _store([first, second], seen)

    async def collect() -> list[Any]:
        return [e if isinstance(e, str) else e.key async for e in store.list_level("p/")]

    assert asyncio.run(collect()) == ["p/a.json", "p/step-1/", "p/step-2/"]  # each once
    assert seen[0] == {"Prefix": "p/", "Delimiter": "/"}
    assert seen[1] == {"Prefix": "p/", "Delimiter": "/", "StartAfter": "p/step-1/\U0010ffff"}
