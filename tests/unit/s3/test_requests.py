"""The request core (``s3ckpt.s3.requests``): a request's tries (HEADs, whole GETs, the
tries of a ranged read) go to the client it looked up once, as it began, and again only
before a retry, so that credentials rotated in the AWS environment while it retries are
its next try's, against a scripted server on loopback."""

from __future__ import annotations

from typing import Any

import pytest
from scripted_servers import ScriptedServers

from s3ckpt.config import S3Config
from s3ckpt.s3 import requests as requests_module
from s3ckpt.s3.client import ClientHandle
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore

_FOUND = b'HTTP/1.1 200 OK\r\nETag: "etag-1"\r\nContent-Length: 0\r\n\r\n'
_FAILED = (
    b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 62\r\n\r\n"
    b"<Error><Code>InternalError</Code><Message>m</Message></Error>"
)


def _looked_up(monkeypatch: pytest.MonkeyPatch) -> list[ClientHandle]:
    """The handles ``Requests`` looks its client up for, each look-up recorded."""
    found: list[ClientHandle] = []
    look_up = requests_module.client_handle

    def recorded(config: S3Config) -> ClientHandle:
        found.append(look_up(config))
        return found[-1]

    monkeypatch.setattr(requests_module, "client_handle", recorded)
    return found


def _store(serve: ScriptedServers, port: int, **options: Any) -> ObjectStore:
    config = S3Config(
        endpoint_url=f"http://127.0.0.1:{port}", region="eu-west-2", max_attempts=3, **options
    )
    return ObjectStore(serve.client(config), "bucket")


_ERROR = b"<Error><Code>InternalError</Code><Message>m</Message></Error>"
_GET_FAILED = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\n\r\n%s" % (
    len(_ERROR),
    _ERROR,
)  # a GET's body is read: its length is exact
_OBJECT = b"0123456789"
_WHOLE = b'HTTP/1.1 200 OK\r\nETag: "etag-2"\r\nContent-Length: 10\r\n\r\n' + _OBJECT
_PART = (
    b'HTTP/1.1 206 Partial Content\r\nETag: "etag-2"\r\nContent-Range: bytes 2-5/10\r\n'
    b"Content-Length: 4\r\n\r\n" + _OBJECT[2:6]
)


def _token(head: bytes) -> str:
    fields = [line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line]
    return next(v.strip().decode() for k, v in fields if k.lower() == b"x-amz-security-token")


def test_a_request_looks_its_client_up_once_and_again_only_before_a_retry(serve, monkeypatch):
    answers = iter([_FAILED, _FOUND, _FOUND])
    server, heads = serve(lambda head: next(answers))
    store = _store(serve, server.port, access_key_id="AKIDREQ", secret_access_key="secret")
    found = _looked_up(monkeypatch)
    assert io_loop().run(store.head("run/obj")).etag == '"etag-1"'  # its second try
    assert len(heads) == 2 and len(found) == 2  # as it began, and before its retry
    assert io_loop().run(store.exists("run/obj"))
    assert len(heads) == 3 and len(found) == 3  # one try, one look-up
    assert found[0] is found[1] is found[2]  # the environment unchanged: the same client


def test_a_retry_after_rotated_credentials_goes_to_the_new_client(monkeypatch, serve):
    # ``serve`` closes its clients before ``monkeypatch`` restores the environment
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDROTATED")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rotated-secret")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "token-one")

    def answer(head: bytes) -> bytes:
        if _token(head) == "token-one":  # the credentials rotate while the request retries
            monkeypatch.setenv("AWS_SESSION_TOKEN", "token-two")
            return _FAILED
        return _FOUND

    server, heads = serve(answer)
    store = _store(serve, server.port)
    found = _looked_up(monkeypatch)
    try:
        assert io_loop().run(store.head("run/obj")).etag == '"etag-1"'
        assert [_token(head) for head in heads] == ["token-one", "token-two"]
        assert len(found) == 2 and found[0] is not found[1]  # a new client for the retry
    finally:
        for handle in found:
            io_loop().run(handle.aclose())


def test_a_get_looks_its_client_up_once_and_again_only_before_a_retry(serve, monkeypatch):
    answers = iter([_GET_FAILED, _WHOLE, _WHOLE])
    server, heads = serve(lambda head: next(answers))
    store = _store(serve, server.port, access_key_id="AKIDGET", secret_access_key="secret")
    found = _looked_up(monkeypatch)
    assert io_loop().run(store.get("run/obj")) == _OBJECT  # its second try
    assert len(heads) == 2 and len(found) == 2  # as it began, and before its retry
    assert io_loop().run(store.get("run/obj")) == _OBJECT
    assert len(heads) == 3 and len(found) == 3  # one try, one look-up
    assert found[0] is found[1] is found[2]


@pytest.mark.parametrize("direct", [True, False], ids=["data-plane", "client"])
def test_a_ranged_read_looks_its_client_up_once_and_again_only_before_a_retry(
    serve, monkeypatch, direct
):
    answers = iter([_GET_FAILED, _PART, _PART])
    server, heads = serve(lambda head: next(answers))
    store = _store(
        serve,
        server.port,
        access_key_id="AKIDRANGE",
        secret_access_key="secret",
        direct_reads=direct,
    )
    found = _looked_up(monkeypatch)
    into = memoryview(bytearray(4))
    io_loop().run(store.read_range("run/obj", 2, 6, into))  # its second try
    assert bytes(into) == _OBJECT[2:6]
    assert len(heads) == 2 and len(found) == 2  # as it began, and before its retry
    io_loop().run(store.read_range("run/obj", 2, 6, into))
    assert len(heads) == 3 and len(found) == 3  # one try, one look-up
    assert found[0] is found[1] is found[2]
