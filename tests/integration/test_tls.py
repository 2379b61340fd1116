"""HTTPS against SeaweedFS serving TLS with a generated CA (``LocalS3Server(tls=True)``).

Saves and loads round trip over HTTPS with upload bodies on the data plane's blocking
TLS sockets (:mod:`s3ckpt.s3.wire.uploads`) and with them left to aiohttp
(``direct_uploads=False``); plain HTTP bodies take the same transport;
verification is as strict as aiobotocore's: a host name the certificate does not name and
a CA the client was not told about each fail at once, with one ``EndpointError`` naming
TLS and the reason, and no credentials in it. The CA is found through ``verify=`` and
through ``AWS_CA_BUNDLE``. Faults injected on the TLS path are retried as over HTTP.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from crc32c import crc32c
from faultproxy import FaultProxy, Rule

from s3ckpt import EndpointError, S3StorageReader, S3StorageWriter, unwrap
from s3ckpt.config import make_config
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.s3.wire import batch, on_loop, pool
from s3ckpt.testing.local_s3 import LocalS3Server

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def tls_s3() -> Iterator[LocalS3Server]:
    with LocalS3Server(tls=True) as server:
        yield server


@pytest.fixture
def options(tls_s3: LocalS3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    return {
        "endpoint_url": tls_s3.https_endpoint_url,
        "verify": str(tls_s3.ca_file),
        "access_key_id": tls_s3.access_key,
        "secret_access_key": tls_s3.secret_key,
        "region": tls_s3.region,
        "part_size": 5 * MiB,
    }


@pytest.fixture
def uri(tls_s3: LocalS3Server, request: pytest.FixtureRequest) -> str:
    return f"s3://{tls_s3.bucket}/{request.node.name.replace('[', '-').strip(']')}-{time.time_ns()}"


@pytest.fixture
def tls_sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The upload bodies' sizes sent on the data plane (HTTPS in worker threads, HTTP on
    the loop or in native batches): its ``PUT`` requests, not the save's other requests
    it also sends (create and complete of a multipart upload, listings, deletes)."""
    sizes: list[int] = []
    send, send_on_loop = pool.send_request, on_loop.send_request
    send_batch = batch.NativeBatch.send

    def counting(connection: Any, head: bytes, body: memoryview) -> Any:
        if head.startswith(b"PUT "):
            sizes.append(len(body))
        return send(connection, head, body)

    async def counting_on_loop(pool: Any, origin: Any, head: bytes, body: memoryview) -> Any:
        if head.startswith(b"PUT "):
            sizes.append(len(body))
        return await send_on_loop(pool, origin, head, body)

    async def counting_batch(batch: Any, url: Any, requests: Any, connections: int) -> Any:
        sizes.extend(len(body) for _, body in requests)
        return await send_batch(batch, url, requests, connections)

    monkeypatch.setattr(pool, "send_request", counting)
    monkeypatch.setattr(on_loop, "send_request", counting_on_loop)
    monkeypatch.setattr(batch.NativeBatch, "send", counting_batch)
    return sizes


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(3 * MiB, generator=generator),  # 12 MiB: a multipart upload
        "small": torch.arange(1000, dtype=torch.int64),
        "bf16": torch.randn(4096, generator=generator).to(torch.bfloat16),
    }


def _round_trip(uri: str, options: dict[str, Any], **writer_options: Any) -> None:
    state = _state()
    dcp.save(state, storage_writer=S3StorageWriter(uri, **options, **writer_options))
    restored = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(restored, storage_reader=S3StorageReader(uri, **options))
    for key, tensor in state.items():
        assert torch.equal(restored[key], tensor), key


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_save_and_load_over_https_send_bodies_on_tls_sockets(uri, options, tls_sends, compression):
    _round_trip(uri, options, compression=compression)
    assert len(tls_sends) >= 3  # data, metadata and manifest
    if compression is None:
        assert sum(tls_sends) >= 12 * MiB  # the tensor bytes went out on the TLS path


def _multipart(options: dict[str, Any], bucket: str) -> list[int]:
    """A three-part upload of 11 MiB from one buffer (memoryviews of it, with their
    CRC32Cs), read back and compared; returns the part sizes."""
    store = ObjectStore(make_config(None, **options), bucket)
    payload = memoryview(torch.randint(0, 255, (11 * MiB,), dtype=torch.uint8).numpy())
    pieces = [payload[: 5 * MiB], payload[5 * MiB : 10 * MiB], payload[10 * MiB :]]

    async def upload() -> None:
        upload_id = await store.create_multipart("multipart/object")
        parts = [
            await store.upload_part("multipart/object", upload_id, n, piece, crc32c(piece))
            for n, piece in enumerate(pieces, start=1)
        ]
        await store.complete_multipart("multipart/object", upload_id, parts)

    io_loop().run(upload())
    assert io_loop().run(store.get("multipart/object")) == payload.tobytes()
    return [len(p) for p in pieces]


def test_a_multipart_upload_over_tls_sockets(tls_s3, options, tls_sends):
    assert tls_sends == _multipart(options, tls_s3.bucket)


def test_save_and_load_over_https_through_aiohttp(uri, options, tls_sends):
    _round_trip(uri, {**options, "direct_uploads": False})
    assert tls_sends == []


def test_the_deprecated_tls_threads_still_turns_the_data_plane_off(uri, options, tls_sends):
    with pytest.warns(DeprecationWarning, match="direct_uploads"):
        _round_trip(uri, {**options, "tls_threads": False})
    assert tls_sends == []


def test_plain_http_bodies_take_the_same_transport(tls_s3, uri, options, tls_sends):
    """The same server's HTTP port: the bodies go through the same data plane."""
    _round_trip(uri, {**options, "endpoint_url": tls_s3.endpoint_url})
    assert sum(tls_sends) >= 12 * MiB


def test_the_aws_ca_bundle_variable_is_honoured(uri, options, tls_sends, monkeypatch):
    monkeypatch.setenv("AWS_CA_BUNDLE", options.pop("verify"))
    _round_trip(uri, options)
    assert tls_sends


def _put(options: dict[str, Any], bucket: str) -> None:
    """One PutObject, which goes through the blocking TLS path first."""
    store = ObjectStore(make_config(None, **options), bucket)
    io_loop().run(store.put("probe/object", b"x" * 1000))


def _assert_tls_error(error: BaseException, reason: str, options: dict[str, Any]) -> None:
    assert isinstance(error, EndpointError), repr(error)
    message = str(error)
    assert "TLS certificate verification failed" in message and reason in message, message
    assert options["secret_access_key"] not in message
    assert options["access_key_id"] not in message


def _dialled_by_address(options: dict[str, Any]) -> None:
    """The certificate names ``localhost``; dialled as 127.0.0.1 it must be refused."""
    options["endpoint_url"] = options["endpoint_url"].replace("localhost", "127.0.0.1")


def _system_cas_only(options: dict[str, Any]) -> None:
    """Without the private CA the chain cannot be verified."""
    options["verify"] = True


@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        (_dialled_by_address, "IP address mismatch"),
        (_system_cas_only, "self-signed certificate in certificate chain"),
    ],
    ids=["host-name-not-in-certificate", "untrusted-certificate"],
)
def test_a_certificate_that_does_not_verify_fails_at_once(
    tls_s3, uri, options, tls_sends, retries, mistake, message
):
    mistake(options)
    with pytest.raises(EndpointError) as info:
        _put(options, tls_s3.bucket)
    _assert_tls_error(info.value, message, options)
    with pytest.raises(BaseException) as info:
        dcp.save(_state(), storage_writer=S3StorageWriter(uri, **options))
    _assert_tls_error(unwrap(info.value), message, options)
    assert retries() == []  # never retried


# How long a stalled response stays silent before the proxy hangs up: far beyond the read
# timeouts that should end the wait for it.
STALL_S = 60.0


@pytest.fixture
def tls_proxy(tls_s3: LocalS3Server) -> Iterator[FaultProxy]:
    """A fault proxy serving the server's own certificate, relaying to its HTTP port."""
    assert tls_s3.tls_files is not None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls_s3.tls_files.cert_file, tls_s3.tls_files.key_file)
    with FaultProxy(tls_s3.endpoint_url, tls=context, seed=3, stall_s=STALL_S) as proxy:
        yield proxy


def _through(proxy: FaultProxy, options: dict[str, Any]) -> dict[str, Any]:
    return {**options, "endpoint_url": f"https://localhost:{proxy.port}"}


def test_faults_on_tls_uploads_are_retried(tls_s3, tls_proxy, options, tls_sends):
    """Each part meets one fault: cut mid-body, answered and then cut, throttled."""
    tls_proxy.add(
        Rule(
            "reset_request", methods=("PUT",), match="partNumber=1", after=256 * 1024, per_request=1
        ),
        Rule("reset_response", methods=("PUT",), match="partNumber=2", after=-1, per_request=1),
        Rule("slowdown", methods=("PUT",), match="partNumber=3", per_request=1),
    )
    sizes = _multipart(_through(tls_proxy, options), tls_s3.bucket)
    assert sorted(tls_sends) == sorted(sizes * 2)  # each part sent twice, on the TLS path
    for fault in ("reset_request", "slowdown", "reset_response"):
        assert tls_proxy.counts[fault] >= 1, tls_proxy.counts


def test_a_silent_server_fails_a_tls_upload_after_the_read_timeout(
    tls_proxy, tls_s3, options, tls_sends, retries
):
    tls_proxy.add(Rule("stall", methods=("PUT",), after=-1, per_request=None))
    options = {**_through(tls_proxy, options), "read_timeout": 1.0, "max_attempts": 2}
    started = time.monotonic()
    with pytest.raises(EndpointError, match="timed out"):
        _put(options, tls_s3.bucket)
    assert len(retries()) == 1  # the first attempt timed out and was tried again
    # Two read timeouts take about 2 s; without them each attempt would wait out the stall.
    assert time.monotonic() - started < STALL_S / 2
    assert tls_sends  # the TLS path, not aiohttp, timed out


def test_the_certificate_files_are_private(tls_s3):
    assert tls_s3.tls_files is not None
    for path in (tls_s3.tls_files.key_file, tls_s3.tls_files.cert_file):
        assert Path(path).stat().st_mode & 0o077 == 0


def test_a_server_without_tls_has_no_https_endpoint(local_s3):
    from s3ckpt.errors import LocalServerError

    with pytest.raises(LocalServerError, match="tls=True"):
        _ = local_s3.https_endpoint_url
    with pytest.raises(LocalServerError, match="tls=True"):
        _ = local_s3.ca_file
