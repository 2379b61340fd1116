"""Secrets stay secret, TLS is verified by default, and a hostile bucket cannot run code."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from crc32c import crc32c
from faultproxy import FaultProxy, Rule

from s3ckpt import (
    AccessDeniedError,
    S3Config,
    S3StorageReader,
    S3StorageWriter,
    UntrustedPickleError,
    unwrap,
)
from s3ckpt.config import S3URI
from s3ckpt.format.manifest import MANIFEST_NAME, sealed
from s3ckpt.s3.client import create_client
from s3ckpt.s3.store import ObjectStore

WRONG_SECRET = "wrong-secret-Zq8xV2pL"


def _texts_of(error: BaseException) -> list[str]:
    """str and repr of an error and of everything it was raised from."""
    texts: list[str] = []
    seen: BaseException | None = error
    while seen is not None and len(texts) < 40:
        texts += [str(seen), repr(seen)]
        seen = seen.__cause__ or seen.__context__
    return texts


def _stored(local_s3, uri: str) -> list[bytes]:
    """Every object under ``uri``, plus the listing's keys."""
    location = S3URI.parse(uri)
    client = local_s3.client()
    listed = client.list_objects_v2(Bucket=location.bucket, Prefix=location.prefix + "/")
    keys = [item["Key"] for item in listed.get("Contents", [])]
    bodies = [client.get_object(Bucket=location.bucket, Key=k)["Body"].read() for k in keys]
    return [*bodies, "\n".join(keys).encode()]


def test_credentials_appear_in_no_log_error_repr_or_stored_byte(
    local_s3, s3_options, s3_prefix, caplog
):
    caplog.set_level(logging.DEBUG)  # every logger, botocore's and aiohttp's included
    secret, key_id = s3_options["secret_access_key"], s3_options["access_key_id"]
    texts: list[str] = []
    with FaultProxy(local_s3.endpoint_url, seed=11) as proxy:
        proxy.add(Rule("slowdown", rate=0.5))  # retries get logged too
        options = {**s3_options, "endpoint_url": proxy.endpoint_url}
        writer = S3StorageWriter(s3_prefix, **options)
        dcp.save({"w": torch.arange(1000.0), "meta": {"note": "hi"}}, storage_writer=writer)
        reader = S3StorageReader(s3_prefix, **options)
        dcp.load({"w": torch.zeros(1000), "meta": {"note": ""}}, storage_reader=reader)
        wrong = {**options, "secret_access_key": WRONG_SECRET}
        with pytest.raises(BaseException) as saving:
            dcp.save({"w": torch.ones(3)}, storage_writer=S3StorageWriter(s3_prefix + "x", **wrong))
        with pytest.raises(AccessDeniedError) as loading:
            S3StorageReader(s3_prefix, **wrong).read_metadata()
        assert proxy.counts["slowdown"] > 0
    assert isinstance(unwrap(saving.value), AccessDeniedError)
    texts += _texts_of(saving.value) + _texts_of(loading.value)
    texts += [repr(o) for o in (writer, reader, writer.config, ObjectStore(writer.config, "b"))]
    records = [r.getMessage() + (caplog.text if r.exc_info else "") for r in caplog.records]
    assert any(r.name.startswith("botocore") for r in caplog.records)  # DEBUG really on
    assert any(r.name == "s3ckpt.s3.retry" for r in caplog.records)
    for text in [*texts, *records, caplog.text]:
        assert secret not in text and WRONG_SECRET not in text
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("s3ckpt")]
    for text in [*texts, *ours]:  # botocore logs the key id in request headers; we never do
        assert key_id not in text
    for body in _stored(local_s3, s3_prefix):
        for value in (secret, key_id):
            assert value.encode() not in body


def test_tls_is_verified_unless_switched_off(monkeypatch, tmp_path):
    from s3ckpt.s3.client import tls_verify

    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    # None: botocore verifies, with the AWS chain's CA bundle; so does the direct reader.
    assert S3Config().verify is None and tls_verify(S3Config()) is True
    monkeypatch.setenv("AWS_CA_BUNDLE", "/etc/private-ca.pem")
    assert tls_verify(S3Config()) == "/etc/private-ca.pem"
    assert tls_verify(S3Config(verify=False)) is False
    seen: dict[str, Any] = {}

    def capture(self, service, **kwargs):
        seen.update(kwargs)
        return None

    monkeypatch.setattr("aiobotocore.session.AioSession.create_client", capture)
    create_client(S3Config(endpoint_url="https://flashblade.example.com"))
    assert seen["verify"] is None  # botocore: verify, with the AWS chain's bundle
    bundle = tmp_path / "ca.pem"
    bundle.write_text("")
    create_client(S3Config(endpoint_url="https://fb.example.com", verify=str(bundle)))
    assert seen["verify"] == str(bundle)


class _Payload:
    """Unpickling this runs ``os.makedirs(marker)``: harmless, and visible."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.makedirs, (str(self.marker),))


def test_hostile_metadata_is_refused_and_runs_nothing(
    local_s3, s3_prefix, make_writer, make_reader, tmp_path
):
    """A bucket owner controls every byte, so the manifest's size and CRC of the metadata
    object match the hostile pickle: only the restricted unpickler stands in the way."""
    dcp.save({"w": torch.ones(4)}, storage_writer=make_writer(s3_prefix))
    location, client = S3URI.parse(s3_prefix), local_s3.client()
    manifest_key = location.key(MANIFEST_NAME)
    manifest = json.loads(
        client.get_object(Bucket=location.bucket, Key=manifest_key)["Body"].read()
    )
    marker = tmp_path / "pwned"
    hostile = pickle.dumps(_Payload(marker), protocol=4)
    client.put_object(
        Bucket=location.bucket, Key=location.key(manifest["metadata_key"]), Body=hostile
    )
    manifest.update(metadata_size=len(hostile), metadata_crc32c=crc32c(hostile))
    del manifest["manifest_crc32c"]  # and seals the manifest again
    body = sealed(json.dumps(manifest, separators=(",", ":")).encode())
    client.put_object(Bucket=location.bucket, Key=manifest_key, Body=body)

    with pytest.raises(UntrustedPickleError, match=r"names os\.makedirs") as refused:
        make_reader(s3_prefix).read_metadata()
    assert refused.value.refused == "os.makedirs"
    assert "trust_pickles=True" in str(refused.value)
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(4)}, storage_reader=make_reader(s3_prefix))
    assert "names os.makedirs" in str(unwrap(info.value))  # DCP rewraps this one
    assert not marker.exists()


def test_a_hostile_non_tensor_item_runs_nothing(s3_prefix, make_writer, make_reader, tmp_path):
    marker = tmp_path / "pwned-by-item"
    dcp.save({"extra": _Payload(marker)}, storage_writer=make_writer(s3_prefix))
    try:
        dcp.load({"extra": None}, storage_reader=make_reader(s3_prefix))
    except BaseException as exc:  # refusing the item is the right outcome
        assert isinstance(unwrap(exc), UntrustedPickleError)
    assert not marker.exists()


class _Schedule:
    """A harmless custom class, as a user's training state might hold."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Schedule) and other.warmup == self.warmup


def test_custom_classes_load_only_when_the_bucket_is_trusted(s3_prefix, make_writer, make_reader):
    dcp.save(
        {"w": torch.ones(2), "schedule": _Schedule(100)}, storage_writer=make_writer(s3_prefix)
    )
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(2), "schedule": None}, storage_reader=make_reader(s3_prefix))
    assert isinstance(unwrap(info.value), UntrustedPickleError)
    assert "trust_pickles" in str(unwrap(info.value))
    restored: dict[str, Any] = {"w": torch.zeros(2), "schedule": None}
    dcp.load(restored, storage_reader=make_reader(s3_prefix, trust_pickles=True))
    assert restored["schedule"] == _Schedule(100)


def test_values_dcp_itself_writes_load_by_default(s3_prefix, make_writer, make_reader):
    """An io.BytesIO in a training state (as PyTorch's own end-to-end DCP tests save) and
    the plain values DCP pickles load without trust_pickles."""
    state = {
        "w": torch.ones(2),
        "history": io.BytesIO(b"loss 1.0\nloss 0.9\n"),
        "meta": {"step": 7, "name": "run", "lr": 0.1, "betas": (0.9, 0.99), "done": None},
        "sizes": torch.Size([3, 4]),
    }
    dcp.save(state, storage_writer=make_writer(s3_prefix))
    restored: dict[str, Any] = {
        "w": torch.zeros(2),
        "history": io.BytesIO(),
        "meta": {"step": 0, "name": "", "lr": 0.0, "betas": (0.0, 0.0), "done": 1},
        "sizes": torch.Size([0]),
    }
    dcp.load(restored, storage_reader=make_reader(s3_prefix))
    assert restored["history"].getvalue() == b"loss 1.0\nloss 0.9\n"
    assert restored["meta"] == state["meta"] and restored["sizes"] == torch.Size([3, 4])


def test_saving_over_a_checkpoint_uses_dcps_wording(s3_prefix, make_writer):
    dcp.save({"w": torch.ones(2)}, storage_writer=make_writer(s3_prefix))
    with pytest.raises(BaseException) as info:
        dcp.save({"w": torch.ones(2)}, storage_writer=make_writer(s3_prefix))
    assert "Checkpoint already exists" in str(unwrap(info.value))
