"""An endpoint that is a web server, not S3 (``--endpoint-url`` pointing at a console's port,
a proxy's landing page): Python, the CLI and doctor all say "this endpoint does not answer
like an S3 server", naming the endpoint and the status, instead of "no such bucket" or an
empty bucket. The server is a plain ``http.server`` on 127.0.0.1 answering every request
with an HTML 404 (its standard error page), or with a 200 HTML page."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import s3ckpt
from s3ckpt import CheckpointManager, NotS3EndpointError, S3StorageReader, S3StorageWriter

NOT_S3 = "this endpoint does not answer like an S3 server"
PAGE = (
    b'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
    b"<title>Welcome</title>\n</head>\n<body><h1>It works</h1><p>A web page.<br></p></body>\n"
    b"</html>\n"
)


class WebPages(http.server.BaseHTTPRequestHandler):
    """Every method, every path: ``status`` with an HTML page (none for HEAD)."""

    status = 404

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        if self.status >= 400:
            self.send_error(self.status)  # http.server's own HTML error page
            return
        self.send_response(self.status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(PAGE)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(params=[404, 200], ids=["html-404", "html-200"])
def web_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    handler = type("Pages", (WebPages,), {"status": request.param})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", request.param
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    env = {
        "AWS_ACCESS_KEY_ID": "AKIDWEBPAGE",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def assert_not_s3(error: BaseException, endpoint: str, status: int) -> None:
    assert isinstance(error, NotS3EndpointError), repr(error)
    text = str(error)
    assert text.startswith(NOT_S3) and f"{endpoint} answered" in text
    assert f"HTTP {status}" in text and "no such bucket" not in text
    assert error.code == str(status)


# -- Python -------------------------------------------------------------------------------


def _save(endpoint: str) -> None:
    writer = S3StorageWriter("s3://ckpt/run/step-1", endpoint_url=endpoint)
    dcp.save({"w": torch.ones(4)}, storage_writer=writer)


def _load(endpoint: str) -> None:
    reader = S3StorageReader("s3://ckpt/run/step-1", endpoint_url=endpoint)
    dcp.load({"w": torch.zeros(4)}, storage_reader=reader)


@pytest.mark.parametrize("call", [_save, _load], ids=["writer", "reader"])
def test_a_writer_and_a_reader_say_the_endpoint_is_not_s3(call, web_server, credentials):
    endpoint, status = web_server
    with pytest.raises(BaseException) as raised:
        call(endpoint)
    assert_not_s3(s3ckpt.unwrap(raised.value), endpoint, status)


def test_a_manager_says_the_endpoint_is_not_s3(web_server, credentials):
    endpoint, status = web_server
    manager = CheckpointManager("s3://ckpt/run", endpoint_url=endpoint, async_mode="thread")
    try:
        with pytest.raises(NotS3EndpointError) as raised:
            manager.save(1, {"w": torch.ones(4)})
            manager.wait()
    finally:
        manager.close()
    assert_not_s3(raised.value, endpoint, status)


# -- the CLI and doctor, in a fresh process ------------------------------------------------


def s3ckpt_command(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = shutil.which("s3ckpt", path=str(Path(sys.executable).parent))
    assert command is not None, "the s3ckpt console script is not installed beside python"
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return subprocess.run(
        [command, *args], env={**base, **env}, capture_output=True, text=True, timeout=120
    )


@pytest.mark.subprocess
@pytest.mark.parametrize("command", ["ls", "show"])
def test_the_cli_says_the_endpoint_is_not_s3(web_server, credentials, command):
    endpoint, status = web_server
    uri = "s3://ckpt/run" if command == "ls" else "s3://ckpt/run/step-1"
    result = s3ckpt_command(command, uri, env={**credentials, "AWS_ENDPOINT_URL": endpoint})
    assert result.returncode == 2, result  # a wrong endpoint, like an unreachable one
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"s3ckpt {command}: error: {NOT_S3}: ")
    assert f"{endpoint} answered" in lines[0] and f"HTTP {status}" in lines[0]
    as_json = s3ckpt_command(command, uri, "--json", "--endpoint-url", endpoint, env=credentials)
    document = json.loads(as_json.stdout)
    assert as_json.returncode == 2 and document["exit"] == 2
    assert document["error"].startswith(NOT_S3) and f"HTTP {status}" in document["error"]


@pytest.mark.subprocess
def test_doctor_says_the_endpoint_is_not_s3(web_server, credentials):
    endpoint, status = web_server
    result = s3ckpt_command(
        "doctor", "s3://ckpt/run", "--json", env={**credentials, "AWS_ENDPOINT_URL": endpoint}
    )
    report = json.loads(result.stdout)
    assert result.returncode == 2 and report["exit_status"] == 2
    assert report["endpoint"] == endpoint and report["endpoint_source"] == "from AWS_ENDPOINT_URL"
    [check] = report["checks"]
    assert check["status"] == "failed"
    assert check["detail"].startswith(NOT_S3) and f"HTTP {status}" in check["detail"]
    assert f"{endpoint} answered" in check["detail"]
