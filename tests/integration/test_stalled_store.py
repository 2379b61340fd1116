"""A store that stops taking bytes (``tests/stalling_proxy.py`` in front of SeaweedFS: it
accepts connections and then reads nothing, as a full Ceph cluster does) fails a save
within ``S3Config.stall_timeout_s``, not at ``deadline_s``, on every route a part takes:
native batches, the event loop, TLS worker threads and aiobotocore. The error names the
stall, the operation, the key and the store's last answer, the bounded clean-up says
what it left for ``gc``, and once the store takes bytes again the next save commits.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch
import torch.distributed.checkpoint as dcp
from stalling_proxy import StallingProxy

from s3ckpt import S3StorageReader, S3StorageWriter, StoreStalledError, unwrap
from s3ckpt.testing.local_s3 import LocalS3Server

MiB = 1024 * 1024
STALL_S = 2.0  # the stall limit: tries stopped after 1 s of silence
DEADLINE_S = 120.0  # what the save would otherwise wait for
# Request bytes let through before the store stops: the save's small requests (its check,
# its in-flight record, the create of the multipart upload) and part of the first part.
STALL_AFTER = 2 * MiB
ROUTES = {
    "native-batches": {},
    "event-loop": {"native_uploads": False},
    "aiobotocore": {"direct_uploads": False},
    "tls-threads": {},
}


@pytest.fixture(scope="module")
def tls_s3() -> Iterator[LocalS3Server]:
    with LocalS3Server(tls=True) as server:
        yield server


def _state(seed: int) -> dict[str, Any]:
    return {f"t{i}": torch.full((MiB,), float(seed * 10 + i)) for i in range(3)}  # 12 MiB


def _options(server: LocalS3Server, route: str) -> tuple[tuple[str, int], dict[str, Any]]:
    """The upstream address and the writer options of ``route`` (endpoint filled in later)."""
    tls = route == "tls-threads"
    url = urlsplit(server.https_endpoint_url if tls else server.endpoint_url)
    options: dict[str, Any] = {
        "access_key_id": server.access_key,
        "secret_access_key": server.secret_key,
        "region": server.region,
        "part_size": 5 * MiB,
        "stall_timeout_s": STALL_S,
        "connect_timeout": 1.0,  # a TLS handshake the stalled store never answers
        "deadline_s": DEADLINE_S,
        **ROUTES[route],
    }
    if tls:
        options["verify"] = str(server.ca_file)
    return (url.hostname or "127.0.0.1", url.port or 443), options


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_save_to_a_store_that_stopped_taking_bytes_fails_within_the_stall_limit(
    route, request, monkeypatch
):
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    server = request.getfixturevalue("tls_s3" if route == "tls-threads" else "seaweedfs_s3")
    upstream, options = _options(server, route)
    uri = f"s3://{server.bucket}/stalled-{route}-{time.time_ns()}"
    with StallingProxy(upstream) as proxy:
        host = "localhost" if route == "tls-threads" else "127.0.0.1"  # the certificate's name
        scheme = "https" if route == "tls-threads" else "http"
        options["endpoint_url"] = f"{scheme}://{host}:{proxy.port}"
        proxy.resume(stall_after=STALL_AFTER)
        started = time.monotonic()
        with pytest.raises(BaseException) as info:
            dcp.save(_state(2), storage_writer=S3StorageWriter(f"{uri}/b", **options))
        took = time.monotonic() - started
        error = unwrap(info.value)
        assert proxy.stalled
        assert isinstance(error, StoreStalledError), repr(error)
        # The limit (2 s), the bounded clean-up (1 s), and room for a loaded host; the
        # deadline would have been 120 s.
        assert took < 4 * STALL_S + 4, took
        text = str(error)
        assert "stalled" in text and "stall_timeout_s" in text
        assert f"s3://{server.bucket}/" in text and error.operation in text
        assert "last answer to this process was" in text
        assert "s3ckpt gc" in text  # the clean-up could not run: what it left is named

        proxy.resume()
        dcp.save(_state(3), storage_writer=S3StorageWriter(f"{uri}/b", **options))
        loaded = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        dcp.load(loaded, storage_reader=S3StorageReader(f"{uri}/b", **options))
        assert all(torch.equal(loaded[k], v) for k, v in _state(3).items())


WORKER = Path(__file__).with_name("_stalled_manager_worker.py")


@pytest.mark.subprocess
def test_a_training_script_learns_of_a_stalled_store_within_the_limit_and_saves_again(
    seaweedfs_s3, s3_prefix
):
    """In a fresh process, as a training script meets it: the manager's save to a store
    that stopped taking bytes fails within the stall limit (2 s there, against a
    900 s deadline), raised at the next call; the previous step still loads; once the
    store takes bytes again, the next save commits and loads."""
    server = seaweedfs_s3
    url = urlsplit(server.endpoint_url)
    args = [url.hostname, str(url.port), server.access_key, server.secret_key, server.region]
    done = subprocess.run(
        [sys.executable, str(WORKER), *args, s3_prefix],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["raised"] == "StoreStalledError" and report["stalled"], report
    assert report["store_stopped"]
    assert report["failed_after_s"] < 12, report  # limit 2 s + clean-up; deadline 900 s
    assert "stalled" in report["message"] and "s3ckpt gc" in report["message"], report
    assert report["latest_after_failure"] == 1 and report["previous_loads"], report
    assert report["latest_after_retry"] == 3 and report["retry_loads"], report
