"""LocalS3Server pieces that need no running server: binary lookup, ports, repr, CLI table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from s3ckpt.cli import main as cli
from s3ckpt.errors import ConfigError, LocalServerError
from s3ckpt.testing.local_s3 import WEED_ENV, LocalS3Server, find_weed
from s3ckpt.testing.weed import free_ports


def fake_weed(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    weed = directory / "weed"
    weed.write_text("#!/bin/sh\nexit 1\n")
    weed.chmod(0o755)
    return weed


@pytest.fixture
def no_weed_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An interpreter in a bin dir without weed, an empty PATH and no override."""
    monkeypatch.delenv(WEED_ENV, raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    return tmp_path


def test_find_weed_order(no_weed_anywhere: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    on_path = fake_weed(no_weed_anywhere / "path")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_weed() == str(on_path)

    beside = fake_weed(no_weed_anywhere / "venv" / "bin")
    assert find_weed() == str(beside)  # the venv's pinned binary wins over PATH

    env = fake_weed(no_weed_anywhere / "env")
    monkeypatch.setenv(WEED_ENV, str(env))
    assert find_weed() == str(env)

    explicit = fake_weed(no_weed_anywhere / "explicit")
    assert find_weed(explicit) == str(explicit)


def test_find_weed_missing_everywhere(no_weed_anywhere: Path) -> None:
    with pytest.raises(LocalServerError, match=r"pip install './s3ckpt\[local\]'"):
        find_weed()


def test_find_weed_bad_override_is_an_error_not_a_fallback(
    no_weed_anywhere: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_weed(no_weed_anywhere / "venv" / "bin")
    monkeypatch.setenv(WEED_ENV, str(no_weed_anywhere / "typo"))
    with pytest.raises(LocalServerError, match=r"\$S3CKPT_WEED.*pip install"):
        find_weed()
    not_executable = no_weed_anywhere / "weed.txt"
    not_executable.write_text("")
    with pytest.raises(LocalServerError, match="weed_path"):
        find_weed(not_executable)


def test_free_ports_distinct_with_admin_pair() -> None:
    ports = free_ports(["a", "b", "c"])
    assert set(ports) == {"a", "b", "c", "admin.port", "admin.port.grpc"}
    assert len(set(ports.values())) == len(ports)
    assert ports["admin.port.grpc"] == ports["admin.port"] + 10000


def test_repr_and_env_without_starting() -> None:
    server = LocalS3Server(["one-bucket", "two-bucket"])
    assert server.bucket == "one-bucket"
    assert "not started" in repr(server)
    assert not server.running
    with pytest.raises(LocalServerError, match="not been started"):
        _ = server.endpoint_url
    server.ports = {"s3.port": 12345}  # as if started, to check the derived values
    assert server.endpoint_url == "http://127.0.0.1:12345"
    assert server.secret_key not in repr(server)
    assert server.env() == {
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:12345",
    }
    server.stop()  # stopping a never-started server is a no-op


def test_credentials_are_random() -> None:
    a, b = LocalS3Server(), LocalS3Server()
    assert a.access_key != b.access_key and a.secret_key != b.secret_key


def test_no_bucket_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        LocalS3Server(())


def test_cli_registers_local_s3(capsys: pytest.CaptureFixture[str]) -> None:
    assert "local-s3" in [c.name for c in cli.COMMANDS]
    with pytest.raises(SystemExit) as exc:
        cli.main(["local-s3", "--help"])
    assert exc.value.code == 0
    assert "--bucket" in capsys.readouterr().out


def test_cli_reports_missing_weed(
    no_weed_anywhere: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["local-s3"]) == 1
    assert "pip install './s3ckpt[local]'" in capsys.readouterr().err


@pytest.mark.subprocess  # starts a fake weed
def test_early_exit_reports_log_tail_and_cleans_up(tmp_path: Path) -> None:
    weed = tmp_path / "weed"
    weed.write_text("#!/bin/sh\necho 'boom: cannot start' >&2\nexit 3\n")
    weed.chmod(0o755)
    server = LocalS3Server(weed_path=weed, startup_timeout=10)
    with pytest.raises(LocalServerError, match=r"(?s)status 3.*boom: cannot start"):
        server.start()
    assert not server.running
    assert server.data_dir is not None and not server.data_dir.exists()
