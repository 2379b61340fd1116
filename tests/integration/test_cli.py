"""The catalog subcommands end to end: output, --json parsed back, exit codes.

Most runs call :func:`s3ckpt.cli.main.main` in-process (fast); two go through the real
``python -m s3ckpt`` entry point. Credentials and the endpoint come from the standard
``AWS_*`` environment variables, as they would for an operator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3_servers import ON_BOTH, held_port
from stored import stored_manifest

from s3ckpt.cli.main import main
from s3ckpt.config import S3URI

pytestmark = [ON_BOTH]  # SeaweedFS and moto


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


@pytest.fixture
def aws_env(local_s3, tmp_path) -> dict[str, str]:
    """The server's AWS_* variables, isolated from any AWS configuration on this machine."""
    return {
        **local_s3.env(),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }


@pytest.fixture
def cli(aws_env, monkeypatch, capsys):
    for name, value in aws_env.items():
        monkeypatch.setenv(name, value)

    def run(*argv: str) -> Result:
        capsys.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse: --help, usage errors
            code = exc.code if isinstance(exc.code, int) else 2
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return run


@pytest.fixture
def run_dir(s3_prefix, make_writer) -> str:
    """A prefix holding step-1, step-2 and step-10 (committed) and step-20 (never committed:
    its coordinator died before the commit, moments ago, so its in-flight record is fresh)."""
    for step in (1, 2, 10):
        state = {"w": torch.full((1000,), float(step)), "step": step}
        dcp.save(state, storage_writer=make_writer(f"{s3_prefix}/step-{step}"))
    writer = make_writer(f"{s3_prefix}/step-20")
    writer.finish = lambda metadata, results: (_ for _ in ()).throw(RuntimeError("died"))  # type: ignore[method-assign]
    with pytest.raises(BaseException, match="died"):
        dcp.save({"w": torch.ones(10)}, storage_writer=writer)
    return s3_prefix


def test_ls_table_and_json(cli, run_dir):
    result = cli("ls", run_dir)
    assert result.code == 0 and result.err == ""
    lines = result.out.splitlines()
    assert lines[0].split() == ["NAME", "TIME", "AGE", "SIZE", "RANKS"]
    assert [line.split()[0] for line in lines[1:]] == ["step-1", "step-2", "step-10"]
    assert "KiB" in lines[1] and len({len(line) for line in lines[1:]}) == 1  # aligned

    rows = cli("ls", run_dir, "--all", "--details", "--json").json()
    assert [(r["name"], r["status"]) for r in rows] == [
        ("step-1", "committed"),
        ("step-2", "committed"),
        ("step-10", "committed"),
        ("step-20", "saving"),  # for all ls can tell: its record was refreshed just now
    ]
    assert rows[0]["items"] == 2 and rows[0]["ranks"] == 1 and rows[0]["bytes"] > 4000
    assert rows[0]["uri"] == f"{run_dir}/step-1" and rows[0]["time"].endswith("Z")
    assert rows[3]["items"] is None and rows[3]["age_seconds"] >= 0
    assert "saving" in cli("ls", run_dir, "--all").out


def test_show(cli, run_dir):
    result = cli("show", f"{run_dir}/step-2")
    assert result.code == 0
    assert "save id" in result.out and "FQN" in result.out
    assert any(line.split()[:3] == ["w", "float32", "[1000]"] for line in result.out.splitlines())
    document = cli("show", f"{run_dir}/step-2", "--json").json()
    assert document["uri"] == f"{run_dir}/step-2" and document["world_size"] == 1
    items = {i["fqn"]: i for i in document["items"]}
    assert items["w"]["length"] == 4000 and items["step"]["kind"] == "bytes"
    assert isinstance(items["w"]["crc32c"], list)


def test_verify_ok_and_a_flipped_byte(cli, run_dir, local_s3):
    uri = f"{run_dir}/step-10"
    ok = cli("verify", uri)
    assert ok.code == 0 and ok.out.startswith("ok")
    location, client = S3URI.parse(uri), local_s3.client()
    item = next(i.stored for i in stored_manifest(client, uri).items if i.fqn == "w")
    key = location.key(item.key)
    body = bytearray(client.get_object(Bucket=location.bucket, Key=key)["Body"].read())
    body[item.offset + 1234] ^= 0x40
    client.put_object(Bucket=location.bucket, Key=key, Body=bytes(body))

    bad = cli("verify", uri)
    assert bad.code == 1 and "DAMAGED" in bad.out and "checksum mismatch" in bad.out
    assert bad.err.count("\n") == 1 and "1 problem" in bad.err
    document = cli("verify", uri, "--json").json()
    assert document["ok"] is False
    assert document["problems"] == [
        {
            "item": "w",
            "key": item.key,
            "problem": f"checksum mismatch in block 0 (object bytes {item.offset}-{item.offset + 4000})",
        }
    ]


def test_prune_dry_run_then_for_real(cli, run_dir):
    dry = cli("prune", run_dir, "--keep-last", "1", "--dry-run", "--json").json()
    assert dry["dry_run"] and [d["name"] for d in dry["deleted"]] == ["step-1", "step-2"]
    assert dry["kept"] == [{"name": "step-10", "reason": "newest"}]
    table = cli("prune", run_dir, "--keep-last", "1", "--keep-every", "2")
    assert table.code == 0 and "deleted 1 checkpoint(s)" in table.out
    assert "keep (every 2)" in table.out
    names = [r["name"] for r in cli("ls", run_dir, "--all", "--json").json()]
    assert names == ["step-2", "step-10", "step-20"]
    recent = cli("prune", run_dir, "--keep-last", "0", "--older-than", "1h", "--json").json()
    assert recent["deleted"] == [] and recent["kept"][0]["reason"] == "too recent"


def test_gc_and_rm(cli, run_dir):
    spared = cli("gc", run_dir, "--json").json()
    assert spared["deleted"] == [] and spared["grace_seconds"] == 3600
    refused = cli("gc", run_dir, "--older-than", "0s")
    assert refused.code == 2 and "--force" in refused.err and "safe minimum" in refused.err
    in_flight = cli("gc", run_dir, "--older-than", "0s", "--force", "--json").json()
    assert in_flight["deleted"] == [] and in_flight["in_flight"] == ["step-20"]
    assert "leave (save in flight)" in cli("gc", run_dir, "--older-than", "0s", "--force").out
    dead = ["--older-than", "0s", "--force", "--in-flight-lease", "0s"]  # known dead
    collected = cli("gc", run_dir, *dead, "--json").json()
    assert [(d["name"], d["reason"]) for d in collected["deleted"]] == [("step-20", "uncommitted")]
    assert collected["objects"] == len(collected["deleted"][0]["keys"]) > 0
    assert any(".s3ckpt-saving-" in k for k in collected["deleted"][0]["keys"])
    assert "removed 0 object(s)" in cli("gc", run_dir, *dead).out

    removed = cli("rm", f"{run_dir}/step-1")
    assert removed.code == 0 and removed.out.startswith(f"removed {run_dir}/step-1 (")
    assert [r["name"] for r in cli("ls", run_dir, "--all", "--json").json()] == [
        "step-2",
        "step-10",
    ]
    again = cli("rm", f"{run_dir}/step-1")
    assert again.code == 1 and again.out == ""
    assert again.err == f"s3ckpt rm: error: no committed checkpoint at {run_dir}/step-1\n"
    # manifest, metadata, one data object and one index object
    assert cli("rm", f"{run_dir}/step-2", "--json").json()["objects"] == 4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["prune", "s3://s3ckpt/run", "--keep-last", "1", "--older-than", "7y"],
            "invalid duration",
        ),
        (["prune", "s3://s3ckpt/run"], "--keep-last"),
        (["gc", "s3://s3ckpt/run", "--older-than", "soon"], "invalid duration"),
        (["ls", "/local/path"], "expected an s3://bucket/prefix URI"),
        (["show", "s3://s3ckpt"], "names a bucket only"),
        (["verify", "s3://s3ckpt/x", "--ca-bundle", "/no/such.pem"], "no such file"),
        (["nosuchcommand"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2_with_one_line(cli, argv, message):
    result = cli(*argv)
    assert result.code == 2 and result.out == ""
    assert result.err.count("\n") == 1 and message in result.err


def test_connection_errors_exit_2(cli, s3_prefix):
    with held_port() as port:
        unreachable = cli("ls", s3_prefix, "--endpoint-url", f"http://127.0.0.1:{port}")
    assert unreachable.code == 2 and "could not connect" in unreachable.err
    missing = cli("show", "s3://no-such-bucket-s3ckpt/x/step-1")
    assert missing.code == 2 and missing.err.startswith("s3ckpt show: error: no such bucket: ")
    assert "s3://no-such-bucket-s3ckpt" in missing.err


def test_show_and_verify_of_a_missing_checkpoint_exit_1(cli, s3_prefix):
    for command in ("show", "verify"):
        result = cli(command, f"{s3_prefix}/step-404")
        assert result.code == 1 and "no committed checkpoint" in result.err


def test_the_real_entry_point(run_dir, aws_env):
    env = {**os.environ, **aws_env}
    command = [sys.executable, "-m", "s3ckpt"]
    listed = subprocess.run(
        [*command, "ls", run_dir, "--json"], env=env, capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    assert [r["name"] for r in json.loads(listed.stdout)] == ["step-1", "step-2", "step-10"]
    missing = subprocess.run(
        [*command, "verify", f"{run_dir}/step-404"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.startswith("s3ckpt verify: error: no committed checkpoint")
    # Refused credentials (a store that checks them; moto's does not): test_errors.py.


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ls", "s3://s3ckpt/x", "--endpoint-url", "http://[::1"], "not a valid URL"),
        (["ls", "s3://s3ckpt/x", "--endpoint-url", "http://me:hunter2@127.0.0.1:9"], "credentials"),
        (["ls", "s3://s3ckpt/x", "--ca-bundle", "/no/such/ca.pem"], "no such file"),
        (["local-s3", "--dir", "/proc/no-such-dir/data"], "data directory"),
    ],
    ids=["bad-ipv6", "credentials-in-url", "missing-ca-bundle", "bad-data-dir"],
)
def test_bad_input_is_one_line_naming_the_command(cli, argv, message):
    result = cli(*argv)
    assert result.code in (1, 2) and result.err.count("\n") == 1, result.err
    assert result.err.startswith(f"s3ckpt {argv[0]}: error:") and message in result.err
    assert "hunter2" not in result.err and "Traceback" not in result.err


def test_ls_of_an_empty_prefix_says_so(cli, s3_prefix):
    result = cli("ls", f"{s3_prefix}/nothing-here")
    assert result.code == 0 and result.out == ""
    assert result.err == f"no committed checkpoints under {s3_prefix}/nothing-here\n"
    assert cli("ls", f"{s3_prefix}/nothing-here", "--json").json() == []


def test_a_reader_that_goes_away_ends_the_command_quietly(run_dir, aws_env):
    env = {**os.environ, **aws_env}
    shell = f"{sys.executable} -m s3ckpt ls {run_dir} --json | head -c 1 > /dev/null"
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", shell], env=env, capture_output=True, text=True, timeout=60
    )
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
