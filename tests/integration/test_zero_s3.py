"""The zero-cost benchmark S3 server (benchmarks/zero_s3.c) answers S3's semantics that
s3ckpt and the benchmark's peers rely on, through boto3."""

from __future__ import annotations

import http.client
import os

import pytest
from botocore.exceptions import ClientError

from benchmarks.zero_server import ZeroS3, compiler

pytestmark = [
    pytest.mark.skipif(compiler() is None, reason="no C compiler (cc) to build the server")
]


@pytest.fixture(scope="module")
def server():
    with ZeroS3() as running:
        yield running


def _code(exc: ClientError) -> str:
    return exc.response["Error"]["Code"]


def test_put_get_range_head(server):
    s3, body = server.client(), os.urandom(100_000)
    etag = s3.put_object(Bucket=server.bucket, Key="a/b c+d", Body=body)["ETag"]
    assert s3.get_object(Bucket=server.bucket, Key="a/b c+d")["Body"].read() == body
    ranged = s3.get_object(Bucket=server.bucket, Key="a/b c+d", Range="bytes=10-19")
    assert ranged["Body"].read() == body[10:20]
    assert ranged["ContentRange"] == f"bytes 10-19/{len(body)}"
    assert (
        s3.get_object(Bucket=server.bucket, Key="a/b c+d", Range="bytes=-5")["Body"].read()
        == body[-5:]
    )
    head = s3.head_object(Bucket=server.bucket, Key="a/b c+d")
    assert (head["ContentLength"], head["ETag"]) == (len(body), etag)
    with pytest.raises(ClientError) as missing:
        s3.get_object(Bucket=server.bucket, Key="nothing")
    assert _code(missing.value) == "NoSuchKey"


def test_conditional_put_and_delete(server):
    s3 = server.client()
    etag = s3.put_object(Bucket=server.bucket, Key="cond", Body=b"1", IfNoneMatch="*")["ETag"]
    with pytest.raises(ClientError) as taken:
        s3.put_object(Bucket=server.bucket, Key="cond", Body=b"2", IfNoneMatch="*")
    assert taken.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert s3.get_object(Bucket=server.bucket, Key="cond")["Body"].read() == b"1"
    with pytest.raises(ClientError) as changed:
        s3.delete_object(Bucket=server.bucket, Key="cond", IfMatch='"other"')
    assert _code(changed.value) == "PreconditionFailed"
    s3.delete_object(Bucket=server.bucket, Key="cond", IfMatch=etag)
    with pytest.raises(ClientError):
        s3.head_object(Bucket=server.bucket, Key="cond")


def test_multipart_complete_abort_and_list_uploads(server):
    s3, parts = server.client(), [os.urandom(5 * 2**20 + 7), os.urandom(1234)]
    upload = s3.create_multipart_upload(Bucket=server.bucket, Key="mp")["UploadId"]
    pending = s3.list_multipart_uploads(Bucket=server.bucket, Prefix="mp")["Uploads"]
    assert [(u["Key"], u["UploadId"]) for u in pending] == [("mp", upload)]
    done = [
        {"PartNumber": n, "ETag": s3.upload_part(Bucket=server.bucket, Key="mp", UploadId=upload,
                                                 PartNumber=n, Body=p)["ETag"]}
        for n, p in enumerate(parts, start=1)
    ]  # fmt: skip
    result = s3.complete_multipart_upload(
        Bucket=server.bucket, Key="mp", UploadId=upload, MultipartUpload={"Parts": done}
    )
    assert result["ETag"].endswith('-2"')
    whole = b"".join(parts)
    assert s3.get_object(Bucket=server.bucket, Key="mp")["Body"].read() == whole
    across = s3.get_object(
        Bucket=server.bucket, Key="mp", Range=f"bytes={len(parts[0]) - 3}-{len(parts[0]) + 2}"
    )
    assert across["Body"].read() == whole[len(parts[0]) - 3 : len(parts[0]) + 3]
    again = s3.create_multipart_upload(Bucket=server.bucket, Key="mp")["UploadId"]
    etag = s3.upload_part(Bucket=server.bucket, Key="mp", UploadId=again, PartNumber=1, Body=b"x")[
        "ETag"
    ]
    with pytest.raises(ClientError) as exists:
        s3.complete_multipart_upload(Bucket=server.bucket, Key="mp", UploadId=again, IfNoneMatch="*",
                                     MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]})  # fmt: skip
    assert _code(exists.value) == "PreconditionFailed"
    s3.abort_multipart_upload(Bucket=server.bucket, Key="mp", UploadId=again)
    with pytest.raises(ClientError) as gone:
        s3.abort_multipart_upload(Bucket=server.bucket, Key="mp", UploadId=again)
    assert _code(gone.value) == "NoSuchUpload"
    assert "Uploads" not in s3.list_multipart_uploads(Bucket=server.bucket, Prefix="mp")


def test_list_v2_pages_prefixes_and_delete_objects(server):
    s3 = server.client()
    keys = [f"l/{d}/{i:03d}" for d in ("x", "y") for i in range(30)] + ["l/top"]
    for key in keys:
        s3.put_object(Bucket=server.bucket, Key=key, Body=key.encode())
    pages = s3.get_paginator("list_objects_v2").paginate(
        Bucket=server.bucket, Prefix="l/", PaginationConfig={"PageSize": 7}
    )
    listed = [o["Key"] for page in pages for o in page.get("Contents", [])]
    assert listed == sorted(keys)
    rolled = s3.list_objects_v2(Bucket=server.bucket, Prefix="l/", Delimiter="/")
    assert [p["Prefix"] for p in rolled["CommonPrefixes"]] == ["l/x/", "l/y/"]
    assert [o["Key"] for o in rolled["Contents"]] == ["l/top"]
    first = s3.list_objects_v2(Bucket=server.bucket, Prefix="l/", Delimiter="/", MaxKeys=2)
    rest = s3.list_objects_v2(Bucket=server.bucket, Prefix="l/", Delimiter="/",
                              ContinuationToken=first["NextContinuationToken"])  # fmt: skip
    assert [o["Key"] for o in first["Contents"]] == ["l/top"]
    assert [p["Prefix"] for p in first["CommonPrefixes"]] == ["l/x/"]
    assert [p["Prefix"] for p in rest["CommonPrefixes"]] == ["l/y/"]
    deleted = s3.delete_objects(
        Bucket=server.bucket, Delete={"Objects": [{"Key": k} for k in keys]}
    )
    assert sorted(d["Key"] for d in deleted["Deleted"]) == sorted(keys)
    assert s3.list_objects_v2(Bucket=server.bucket, Prefix="l/")["KeyCount"] == 0


def _raw_put(server, path: str, headers: dict[str, str], body: bytes) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.putrequest("PUT", path, skip_accept_encoding=True)
    for name, value in headers.items():
        connection.putheader(name, value)
    connection.endheaders(body)
    status = connection.getresponse().status
    connection.close()
    return status


def _chunks(data: bytes, size: int, extension: str = "") -> bytes:
    pieces = [data[i : i + size] for i in range(0, len(data), size)]
    return b"".join(b"%x%s\r\n%s\r\n" % (len(p), extension.encode(), p) for p in pieces)


def test_chunked_and_aws_chunked_bodies(server):
    """Bodies framed as botocore's checksum trailers (HTTPS only there), the CRT and
    streaming clients send them: Transfer-Encoding: chunked, and aws-chunked (signed
    chunk extensions, an x-amz-checksum trailer) framed by Content-Length or by chunks."""
    s3, body = server.client(), os.urandom(300_001)
    http_chunked = _chunks(body, 65_536) + b"0\r\nx-trailer: 1\r\n\r\n"
    assert (
        _raw_put(server, f"/{server.bucket}/te", {"Transfer-Encoding": "chunked"}, http_chunked)
        == 200
    )
    aws = (
        _chunks(body, 65_536, ";chunk-signature=ab12")
        + b"0;chunk-signature=cd\r\nx-amz-checksum-crc32:AAAAAA==\r\n\r\n"
    )
    aws_headers = {"Content-Encoding": "aws-chunked", "x-amz-trailer": "x-amz-checksum-crc32",
                   "x-amz-decoded-content-length": str(len(body))}  # fmt: skip
    assert (
        _raw_put(
            server, f"/{server.bucket}/aws", {**aws_headers, "Content-Length": str(len(aws))}, aws
        )
        == 200
    )
    both = _chunks(aws, 50_000) + b"0\r\n\r\n"
    assert (
        _raw_put(
            server, f"/{server.bucket}/both", {**aws_headers, "Transfer-Encoding": "chunked"}, both
        )
        == 200
    )
    for key in ("te", "aws", "both"):
        assert s3.get_object(Bucket=server.bucket, Key=key)["Body"].read() == body, key


def test_s3ckpt_saves_and_loads_through_it(server):
    """s3ckpt's own client end to end: the conditional-commit probe, multipart parts cut
    at item boundaries, the direct ranged reads, listing and deleting (``gc``-style)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from s3ckpt import S3StorageReader, S3StorageWriter

    state = {
        "big": torch.randn(3 * 2**20),
        "small": torch.arange(100),
        "half": torch.randn(7, 5).half(),
    }
    uri = f"s3://{server.bucket}/ckpt/step1"
    options = {"endpoint_url": server.endpoint_url, "access_key_id": "a", "secret_access_key": "b"}
    dcp.save(state, storage_writer=S3StorageWriter(uri, **options))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=S3StorageReader(uri, **options))
    assert all(torch.equal(state[k], target[k]) for k in state)
    s3 = server.client()
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=server.bucket, Prefix="ckpt/")["Contents"]]
    assert keys and not any(".s3ckpt-probe" in k for k in keys)  # the probe cleaned up after itself


def test_https_port_serves_the_same_objects():
    """Built with OpenSSL, it also speaks HTTPS (what TLS costs a client is measured there)."""
    import boto3

    try:
        running = ZeroS3(tls=True)
        running.start()
    except RuntimeError as exc:
        pytest.skip(str(exc))  # built without OpenSSL's headers: plain HTTP only
    try:
        plain = running.client()
        plain.put_object(Bucket=running.bucket, Key="t", Body=b"x" * 3_000_000)
        secure = boto3.client("s3", endpoint_url=running.https_endpoint_url, verify=running.ca_file,
                              aws_access_key_id="a", aws_secret_access_key="b", region_name="us-east-1")  # fmt: skip
        assert secure.get_object(Bucket=running.bucket, Key="t")["Body"].read() == b"x" * 3_000_000
        secure.put_object(Bucket=running.bucket, Key="u", Body=b"y" * 2_000_000)
        assert plain.get_object(Bucket=running.bucket, Key="u")["Body"].read() == b"y" * 2_000_000
    finally:
        running.stop()


def test_dataplane_benchmark_runs_end_to_end(tmp_path):
    """``python -m benchmarks.zero_cost`` at a tiny size: the floor and s3ckpt's cases run
    in their own processes, and the report carries throughput, client and server CPU and
    the targets (timings are not asserted)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    cases = "socket_upload,socket_download,s3ckpt_save,s3ckpt_load"
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.zero_cost", "--size-mib", "8", "--reps", "1",
         "--no-parallel", "--cases", cases, "--out", str(tmp_path)],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    report = json.loads((tmp_path / "dataplane.json").read_text())
    for case in cases.split(","):
        entry = report["cases"][case]
        assert entry["mbps_best"] > 0 and entry["cpu_s_per_gib_best"] > 0, entry
        assert entry["server_cpu_s_per_gib"] >= 0
    rows = {row["target"]: row for row in report["targets"]}
    assert (
        rows["save client CPU-s/GiB"]["value"]
        == report["cases"]["s3ckpt_save"]["cpu_s_per_gib_best"]
    )
    assert rows["save MB/s / s5cmd upload"]["met"] is None  # not run here: not measured
    assert "save client CPU-s/GiB" in completed.stdout
