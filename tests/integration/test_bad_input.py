"""Bad input the other suites leave out: an empty state dict, unsavable objects, TLS.

``test_errors.py`` covers bad URIs, wrong credentials, a missing bucket and an unreachable
endpoint; ``test_failures.py`` an unpicklable object; ``test_roundtrip.py`` keys with
unicode, spaces and slashes. Each case here must give one clear error and write nothing.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from faultproxy import FaultProxy
from s3_servers import held_port

from s3ckpt import ConfigError, EndpointError, S3StorageReader, S3StorageWriter, catalog, unwrap
from s3ckpt.config import make_config
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore


def test_an_empty_state_dict_saves_and_loads_as_an_empty_checkpoint(
    s3_prefix, make_writer, make_reader, s3_options
):
    """DCP saves ``{}`` with any storage (no items, metadata only): so does s3ckpt."""
    dcp.save({}, storage_writer=make_writer(s3_prefix))
    restored: dict[str, Any] = {}
    dcp.load(restored, storage_reader=make_reader(s3_prefix))
    assert restored == {}
    manifest = catalog.show_checkpoint(s3_prefix, config=make_config(None, **s3_options))
    assert manifest.items == () and manifest.objects == ()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (torch.empty(4, device="meta"), "meta tensor"),
        ((i for i in range(3)), "pickle"),
    ],
    ids=["meta-tensor", "generator"],
)
def test_an_object_that_cannot_be_saved_is_named_and_nothing_is_written(
    value, message, s3_prefix, make_writer, list_keys, pending_uploads
):
    state = {"fine": torch.ones(1000), "bad": value}
    with pytest.raises(BaseException, match=message):
        dcp.save(state, storage_writer=make_writer(s3_prefix))
    assert list_keys(s3_prefix) == [] and pending_uploads(s3_prefix) == []


# -- TLS ------------------------------------------------------------------------------------


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by itself, and its key."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture
def tls_endpoint(local_s3, tmp_path) -> Iterator[tuple[str, Path]]:
    """An HTTPS endpoint with a self-signed certificate in front of the local server."""
    cert, key = _self_signed(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    with FaultProxy(local_s3.endpoint_url, tls=context) as proxy:
        yield proxy.endpoint_url, cert


def test_an_unverifiable_certificate_fails_at_once_naming_tls(
    tls_endpoint, s3_prefix, s3_options, list_keys, retries
):
    endpoint, _ = tls_endpoint
    options = {**s3_options, "endpoint_url": endpoint}
    with pytest.raises(BaseException) as info:
        dcp.save({"a": torch.ones(3)}, storage_writer=S3StorageWriter(s3_prefix, **options))
    error = unwrap(info.value)
    assert isinstance(error, EndpointError) and "TLS" in str(error), error
    with pytest.raises(EndpointError, match="TLS"):
        S3StorageReader(s3_prefix, **options).read_metadata()
    assert retries() == []  # a certificate is not retried
    assert list_keys(s3_prefix) == []


def test_direct_ranged_gets_refuse_an_unverifiable_certificate_at_once(
    tls_endpoint, local_s3, s3_prefix, s3_options, retries
):
    """The data plane (s3ckpt.s3.wire) checks certificates like aiobotocore does."""
    endpoint, cert = tls_endpoint
    key = f"{s3_prefix.split('/', 3)[3]}/blob"
    local_s3.client().put_object(Bucket=local_s3.bucket, Key=key, Body=b"x" * 100)

    def read(verify: bool | str) -> bytes:
        config = make_config(None, **{**s3_options, "endpoint_url": endpoint, "verify": verify})
        store = ObjectStore(config, local_s3.bucket)
        received = bytearray(100)
        io_loop().run(store.read_range(key, 0, 100, memoryview(received)))
        return bytes(received)

    with pytest.raises(EndpointError, match="TLS"):
        read(True)
    assert retries() == []  # a certificate is not retried
    assert read(str(cert)) == b"x" * 100


@pytest.mark.parametrize("verify", ["ca-bundle", False], ids=["private-ca", "verify-off"])
def test_tls_with_a_private_ca_or_verification_off_works(
    tls_endpoint, s3_prefix, s3_options, verify
):
    endpoint, cert = tls_endpoint
    options = {
        **s3_options,
        "endpoint_url": endpoint,
        "verify": str(cert) if verify == "ca-bundle" else False,
    }
    state = {"a": torch.arange(1000.0)}
    dcp.save(state, storage_writer=S3StorageWriter(s3_prefix, **options))
    restored = {"a": torch.zeros(1000)}
    dcp.load(restored, storage_reader=S3StorageReader(s3_prefix, **options))
    assert torch.equal(restored["a"], state["a"])


def test_a_sparse_tensor_is_refused_by_name(s3_prefix, make_writer, list_keys):
    sparse = torch.eye(4).to_sparse()
    with pytest.raises(BaseException) as info:
        dcp.save({"w": torch.ones(2), "adjacency": sparse}, storage_writer=make_writer(s3_prefix))
    error = unwrap(info.value)
    assert "adjacency" in str(error) and "to_dense" in str(error)
    assert list_keys(s3_prefix) == []


# -- where the CA bundle and the proxy come from ------------------------------------------------


def _round_trip(s3_prefix: str, options: dict, direct_reads: bool) -> None:
    state = {"a": torch.arange(300_000, dtype=torch.float32)}
    dcp.save(state, storage_writer=S3StorageWriter(s3_prefix, **options))
    restored = {"a": torch.zeros(300_000)}
    reader = S3StorageReader(s3_prefix, direct_reads=direct_reads, **options)
    dcp.load(restored, storage_reader=reader)
    assert torch.equal(restored["a"], state["a"])


@pytest.mark.parametrize("direct_reads", [True, False], ids=["direct", "aiobotocore"])
def test_aws_ca_bundle_is_honoured_on_every_path(
    tls_endpoint, s3_prefix, s3_options, monkeypatch, direct_reads
):
    endpoint, cert = tls_endpoint
    monkeypatch.setenv("AWS_CA_BUNDLE", str(cert))
    _round_trip(s3_prefix, {**s3_options, "endpoint_url": endpoint}, direct_reads)


def test_the_config_files_ca_bundle_is_honoured(
    tls_endpoint, s3_prefix, s3_options, monkeypatch, tmp_path
):
    endpoint, cert = tls_endpoint
    config_file = tmp_path / "aws-config"
    config_file.write_text(f"[default]\nca_bundle = {cert}\n")
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config_file))
    _round_trip(s3_prefix, {**s3_options, "endpoint_url": endpoint}, direct_reads=True)


def test_the_cli_takes_a_ca_bundle(tls_endpoint, s3_prefix, s3_options, monkeypatch, capsys):
    from s3ckpt.cli.main import main

    endpoint, cert = tls_endpoint
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_options["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_options["secret_access_key"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3_options["region"])
    assert main(["ls", s3_prefix, "--endpoint-url", endpoint]) == 2
    assert "TLS" in capsys.readouterr().err
    assert main(["ls", s3_prefix, "--endpoint-url", endpoint, "--ca-bundle", str(cert)]) == 0


def test_a_configured_proxy_is_used_by_every_request(s3_prefix, s3_options):
    from s3ckpt.s3.wire import proxied

    with held_port() as port:
        proxies = {"http": f"http://127.0.0.1:{port}"}
        options = {**s3_options, "proxies": proxies, "max_attempts": 1}
        assert proxied(s3_options["endpoint_url"], proxies)  # so no direct reads either
        with pytest.raises(EndpointError):
            S3StorageReader(s3_prefix, **options).read_metadata()


def test_no_proxy_bypasses_the_environments_proxy(s3_prefix, s3_options, monkeypatch):
    with held_port() as port:
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        _round_trip(s3_prefix, dict(s3_options), direct_reads=True)
        monkeypatch.delenv("NO_PROXY")
        with pytest.raises(BaseException) as info:
            _round_trip(f"{s3_prefix}-2", {**s3_options, "max_attempts": 1}, direct_reads=True)
    assert isinstance(unwrap(info.value), EndpointError)


def test_rank_local_metadata_mode_is_refused_with_a_clear_error(s3_prefix, s3_options, list_keys):
    """DCP's use_collectives=False writes rank-local metadata and no global commit; s3ckpt's
    coordinator commits for all ranks, so it says so before anything is written."""
    writer = S3StorageWriter(s3_prefix, **s3_options)
    with pytest.raises(BaseException) as info:
        dcp.save({"a": torch.ones(3)}, storage_writer=writer, use_collectives=False)
    error = unwrap(info.value)
    assert isinstance(error, ConfigError) and "use_collectives=True" in str(error)
    assert list_keys(s3_prefix) == []
