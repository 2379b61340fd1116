"""Objects that are not s3ckpt's, as a user meets them through ``s3ckpt``: never listed as
checkpoints, never read as one, never deleted; and what a stopped save left, said plainly.

Commands run as an operator runs them (``python -m s3ckpt`` in a child process, where log
records reach stderr), except where the store's clock is moved forward (in-process). Every
foreign object is checked afterwards with a raw boto3 client, byte for byte.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3_servers import ON_BOTH

from s3ckpt.config import S3URI

pytestmark = [ON_BOTH]  # SeaweedFS and moto

FOREIGN_MANIFESTS = {
    "json/step-2": b'{"hello": 1}',  # what a user found listed as committed, and lost to rm
    "text/step-2": b"written by another tool\n",
    "other/step-2": b'{"format": "orbax-checkpoint", "version": 3, "items": []}',
    "list/step-2": b"[1, 2, 3]",
}


class Raw:
    """The bucket through boto3 alone, for putting and checking foreign objects."""

    def __init__(self, server, prefix: str) -> None:
        self.client, self.location = server.client(), S3URI.parse(prefix)
        self.bucket = self.location.bucket

    def put(self, rel: str, body: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.location.key(rel), Body=body)

    def get(self, rel: str) -> bytes | None:
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.location.key(rel))
        except self.client.exceptions.NoSuchKey:
            return None
        return got["Body"].read()

    def keys(self, rel: str = "") -> set[str]:
        prefix = self.location.key(rel)
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        )
        return {
            o["Key"][len(self.location.key("")) :] for p in pages for o in p.get("Contents", [])
        }

    def intact(self, objects: dict[str, bytes]) -> None:
        for rel, body in objects.items():
            assert self.get(rel) == body, f"{rel} was changed or deleted"


def _save(make_writer, uri: str, value: float = 1.0, **options) -> None:
    state = {"w": torch.full((64,), value), "step": int(value)}
    dcp.save(state, storage_writer=make_writer(uri, **options))


@pytest.fixture
def s3ckpt(forked_commands, local_s3, tmp_path):
    """``python -m s3ckpt ARGV`` in a child process, against the test's server."""
    return lambda *argv: forked_commands.run(local_s3, tmp_path, *argv)


def _one_line_refusal(result, command: str, where: str) -> None:
    assert result.code == 1, (result.code, result.err)
    assert result.err.count("\n") == 1, result.err
    assert result.err.startswith(f"s3ckpt {command}: error: {where}/manifest.json is not s3ckpt's")
    assert "reading it again" not in result.err


def test_a_foreign_manifest_is_no_checkpoint_for_any_command(
    s3ckpt, local_s3, s3_prefix, make_writer, tmp_path
):
    raw = Raw(local_s3, s3_prefix)
    foreign = {f"{d}/manifest.json": body for d, body in FOREIGN_MANIFESTS.items()}
    foreign["json/step-2/weights.bin"] = b"\x00" * 100  # the other tool's data beside it
    for rel, body in foreign.items():
        raw.put(rel, body)
    _save(make_writer, f"{s3_prefix}/json/step-1")  # a real checkpoint beside them

    listed = s3ckpt("ls", s3_prefix, "--all", "--json")
    assert listed.code == 0 and "reading it again" not in listed.err
    rows = {r["name"]: r for r in listed.json()}
    assert rows["json/step-1"]["status"] == "committed"
    for name in FOREIGN_MANIFESTS:
        row = rows[name]
        assert row["status"] == "foreign" and row["save_id"] is None, row
        assert row["foreign"].startswith(f"{s3_prefix}/{name}/manifest.json is not s3ckpt's")
        assert f"{name}/manifest.json is not s3ckpt's" in listed.err  # one note each
    table = s3ckpt("ls", s3_prefix, "--all")
    lines = {line.split()[0]: line.split()[1] for line in table.out.splitlines()[1:]}
    assert lines == {"json/step-1": "committed", **dict.fromkeys(FOREIGN_MANIFESTS, "foreign")}
    committed_only = s3ckpt("ls", s3_prefix, "--json")
    assert [r["name"] for r in committed_only.json()] == ["json/step-1"]
    assert committed_only.code == 0 and committed_only.err.count("is not s3ckpt's") == 4

    junk = f"{s3_prefix}/json/step-2"
    for command in ("show", "verify", "rm"):
        _one_line_refusal(s3ckpt(command, junk), command, junk)
    _one_line_refusal(s3ckpt("cp", junk, f"{s3_prefix}/copy/step-2"), "cp", junk)
    _one_line_refusal(s3ckpt("export", junk, str(tmp_path / "out")), "export", junk)
    assert not (tmp_path / "out").exists()
    for name in ("text/step-2", "other/step-2", "list/step-2"):
        _one_line_refusal(s3ckpt("rm", f"{s3_prefix}/{name}"), "rm", f"{s3_prefix}/{name}")
    # A destination holding another tool's manifest is not overwritten either.
    into = s3ckpt("cp", f"{s3_prefix}/json/step-1", junk, "--overwrite")
    _one_line_refusal(into, "cp", junk)
    raw.intact(foreign)
    assert not raw.keys("copy/")

    dry = s3ckpt("prune", s3_prefix, "--keep-last", "0", "--force", "--dry-run", "--json")
    assert dry.code == 0 and [d["name"] for d in dry.json()["deleted"]] == ["json/step-1"]
    assert [k["name"] for k in dry.json()["kept"]] == []
    assert dry.err.count("s3ckpt: prune: note: ") == 4 and "reading it again" not in dry.err
    assert sorted(dry.json()["foreign"]) == sorted(rows[n]["foreign"] for n in FOREIGN_MANIFESTS)
    itself = s3ckpt("prune", junk, "--keep-last", "0", "--force")  # pointed at it: refused
    _one_line_refusal(itself, "prune", junk)
    pruned = s3ckpt("prune", s3_prefix, "--keep-last", "0", "--force", "--json")
    assert pruned.code == 0 and [d["name"] for d in pruned.json()["deleted"]] == ["json/step-1"]
    collected = s3ckpt(
        "gc", s3_prefix, "--older-than", "0s", "--force", "--in-flight-lease", "0s", "--json"
    )
    assert collected.code == 0 and collected.json()["objects"] == 0
    raw.intact(foreign)
    assert raw.keys() == set(foreign)  # everything s3ckpt's is gone, nothing else


# Names beside what s3ckpt writes inside a checkpoint, close to its own but not of their form
# (docs/format.md), and objects beside the checkpoints.
LOOKALIKES = {
    "step-1/README.md": b"notes",
    "step-1/Manifest.json": b"{}",
    "step-1/manifest.json.bak": b'{"format": "s3ckpt"}',
    "step-1/metadata.pkl": b"pickle-ish",
    "step-1/metadata-final.pkl": b"not hex",
    "step-1/data/model.bin": b"\x01" * 64,
    "step-1/data/r0-abc-0.bin": b"\x02" * 64,
    "step-1/data/r00000-abc.bin": b"\x03" * 64,
    "step-1/data/zz/r00000-0123456789abcdef-0000.bin": b"\x04" * 64,
    "step-1/index/r0.json": b"[]",
    "step-1/index/r00000.json": b"[]",
    "step-1/.s3ckpt-saving-notes": b"x",
    "step-1/.s3ckpt-claim-mine": b"x",
    "step-1/.s3ckpt-probe-zz": b"x",
    "notes.txt": b"beside the checkpoints",
    "step-1.tar": b"an archive",
    "scratch/data/model.bin": b"\x05" * 64,
    "scratch/metadata.json": b"{}",
}


def test_objects_beside_and_inside_checkpoints_survive_gc_prune_and_rm(
    s3ckpt, local_s3, s3_prefix, make_writer
):
    raw = Raw(local_s3, s3_prefix)
    for step in (1, 2, 3):
        _save(make_writer, f"{s3_prefix}/step-{step}", float(step))
    for rel, body in LOOKALIKES.items():
        raw.put(rel, body)
    ours = raw.keys() - set(LOOKALIKES)

    listed = s3ckpt("ls", s3_prefix, "--all", "--json").json()
    assert [(r["name"], r["status"]) for r in listed] == [
        ("step-1", "committed"),
        ("step-2", "committed"),
        ("step-3", "committed"),
    ]
    sizes = {r["name"]: r["objects"] for r in listed}
    assert sizes["step-1"] == sizes["step-2"]  # the lookalikes are not counted as s3ckpt's

    dead = ["--older-than", "0s", "--force", "--in-flight-lease", "0s", "--json"]
    collected = s3ckpt("gc", s3_prefix, *dead)
    assert collected.code == 0 and collected.json()["objects"] == 0, collected.out
    raw.intact(LOOKALIKES)

    pruned = s3ckpt("prune", s3_prefix, "--keep-last", "2", "--json")
    assert pruned.code == 0 and [d["name"] for d in pruned.json()["deleted"]] == ["step-1"]
    removed = s3ckpt("rm", f"{s3_prefix}/step-2")
    assert removed.code == 0 and removed.out.startswith(f"removed {s3_prefix}/step-2 (")
    assert s3ckpt("gc", s3_prefix, *dead).json()["objects"] == 0
    raw.intact(LOOKALIKES)
    left = raw.keys()
    assert left - set(LOOKALIKES) == {k for k in ours if k.startswith("step-3/")}
    assert s3ckpt("verify", f"{s3_prefix}/step-3").code == 0


def test_a_foreign_manifest_over_a_stopped_save_keeps_every_object(
    s3ckpt, local_s3, s3_prefix, make_writer
):
    """A directory holding another tool's manifest.json and s3ckpt objects of a save that
    died there: no checkpoint, nothing in it deleted by prune or gc."""
    raw = Raw(local_s3, s3_prefix)
    writer = make_writer(f"{s3_prefix}/step-5")
    writer.finish = lambda metadata, results: (_ for _ in ()).throw(RuntimeError("died"))  # type: ignore[method-assign]
    with pytest.raises(BaseException, match="died"):
        dcp.save({"w": torch.ones(16)}, storage_writer=writer)
    raw.put("step-5/manifest.json", b'{"tool": "another", "files": ["weights.bin"]}')
    before = {rel: raw.get(rel) for rel in raw.keys("")}

    rows = s3ckpt("ls", s3_prefix, "--all", "--json").json()
    assert [(r["name"], r["status"]) for r in rows] == [("step-5", "foreign")]
    assert rows[0]["left_objects"] == 0 and rows[0]["gc_after"] is None  # no save's leftovers
    dead = ["--older-than", "0s", "--force", "--in-flight-lease", "0s", "--json"]
    assert (
        s3ckpt("prune", s3_prefix, "--keep-last", "0", "--force", "--json").json()["deleted"] == []
    )
    gc = s3ckpt("gc", s3_prefix, *dead).json()
    assert all(".s3ckpt-saving-" in k for d in gc["deleted"] for k in d["keys"])  # only its record
    raw.intact({rel: body for rel, body in before.items() if ".s3ckpt-saving-" not in rel})


# -- what a stopped save left --------------------------------------------------------------


@pytest.fixture
def later(monkeypatch):
    """Move the store's clock, as ``ls`` reads it, forward by some seconds."""
    from s3ckpt.catalog import listing

    real = listing.store_time

    def move(seconds: float) -> None:
        async def moved(store):
            return await real(store) + seconds

        monkeypatch.setattr(listing, "store_time", moved)

    return move


def _killed(make_writer, uri: str, **options) -> str:
    """A save into ``uri`` whose process died before its commit: its objects and its
    in-flight record stay. Returns its save id."""
    writer = make_writer(uri, **options)
    writer.finish = lambda metadata, results: (_ for _ in ()).throw(RuntimeError("killed"))  # type: ignore[method-assign]
    with pytest.raises(BaseException, match="killed"):
        dcp.save({"w": torch.zeros(64), "step": 1}, storage_writer=writer)
    return writer.save_id


def test_ls_says_what_a_stopped_save_left_and_when_gc_removes_it(
    cli, local_s3, s3_prefix, make_writer, later
):
    raw = Raw(local_s3, s3_prefix)
    _save(make_writer, f"{s3_prefix}/step-1")
    time.sleep(1.1)  # the overwrite starts after the commit, in the store's whole seconds too
    overwrite = _killed(make_writer, f"{s3_prefix}/step-1", overwrite=True)
    upload = raw.client.create_multipart_upload(
        Bucket=raw.bucket, Key=raw.location.key(f"step-1/data/r00000-{overwrite}-0001.bin")
    )
    _killed(make_writer, f"{s3_prefix}/step-2")  # died before its first commit

    def status() -> dict[str, dict]:
        result = cli("ls", s3_prefix, "--all", "--json")
        assert result.code == 0, result.err
        return {row["name"]: row for row in result.json()}

    rows = status()
    assert rows["step-1"]["status"] == "committed, overwrite in flight"  # refreshed just now
    assert rows["step-2"]["status"] == "saving"
    assert all(r["in_flight"] and r["gc_after"] is None for r in rows.values())

    later(3 * 60)  # two heartbeats missed: most likely stopped, but gc still waits
    rows = status()
    quiet = r"committed, overwrite silent 3m( \d+s)? \(stopped\?\): (\d+) objects, 1 open upload"
    gone = r" left; gc removes them in 59m( \d+s)?"
    assert re.fullmatch(quiet + gone, rows["step-1"]["status"]), rows["step-1"]
    assert re.fullmatch(
        r"uncommitted, save silent 3m( \d+s)? \(stopped\?\): \d+ objects" + gone,
        rows["step-2"]["status"],
    ), rows["step-2"]
    row = rows["step-1"]
    assert row["in_flight"] and 180 <= row["silent_seconds"] < 200 and row["left_objects"] >= 2

    later(10 * 60)  # past the lease: what the crash left, plainly
    rows = status()
    left = r"committed, a stopped save left (\d+) objects, 1 open upload; gc removes them in 59m"
    assert re.fullmatch(left + r"( \d+s)?", rows["step-1"]["status"]), rows["step-1"]
    assert re.fullmatch(r"uncommitted, save stopped: \d+ objects" + gone, rows["step-2"]["status"])
    assert not any(r["in_flight"] for r in rows.values())
    assert all(r["gc_after"].endswith("Z") for r in rows.values())
    table = cli("ls", s3_prefix)  # without --all, a status column says it too
    assert "a stopped save left" in table.out and "STATUS" in table.out

    # gc agrees: nothing inside its grace, and past it exactly what ls counted.
    early = cli("gc", s3_prefix, "--older-than", "15m", "--in-flight-lease", "0s", "--dry-run")
    assert "would remove 0 object(s), 0 B, and " in early.out  # (SeaweedFS dates uploads oddly)
    dead = ["--older-than", "0s", "--force", "--in-flight-lease", "0s", "--dry-run", "--json"]
    report = cli("gc", s3_prefix, *dead).json()
    counted = {n: sum(d["objects"] for d in report["deleted"] if d["name"] == n) for n in rows}
    assert counted == {n: r["left_objects"] for n, r in rows.items()}, report
    assert [u["key"] for u in report["aborted_uploads"]] == [upload["Key"]]
    raw.client.abort_multipart_upload(
        Bucket=raw.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
    )
    assert json.loads(cli("show", f"{s3_prefix}/step-1", "--json").out)["save_id"] != overwrite


def test_the_python_api_refuses_and_lists_a_foreign_manifest_as_the_commands_do(
    local_s3, s3_prefix, s3_options, make_writer
):
    from s3ckpt import catalog
    from s3ckpt.errors import CheckpointError, ForeignObjectError
    from s3ckpt.interop.copy import copy_checkpoint

    raw = Raw(local_s3, s3_prefix)
    raw.put("step-2/manifest.json", FOREIGN_MANIFESTS["json/step-2"])
    _save(make_writer, f"{s3_prefix}/step-1")
    junk = f"{s3_prefix}/step-2"
    for call in (
        lambda: catalog.show_checkpoint(junk, **s3_options),
        lambda: catalog.verify_checkpoint(junk, **s3_options),
        lambda: catalog.remove_checkpoint(junk, **s3_options),
        lambda: copy_checkpoint(junk, f"{s3_prefix}/copy", **s3_options),
    ):
        with pytest.raises(ForeignObjectError, match=f"^{junk}/manifest.json is not s3ckpt's"):
            call()
    assert issubclass(ForeignObjectError, CheckpointError)

    problems: list[str] = []
    assert [
        i.name for i in catalog.list_checkpoints(s3_prefix, problems=problems, **s3_options)
    ] == ["step-1"]
    assert len(problems) == 1 and "step-2/manifest.json is not s3ckpt's" in problems[0]
    everything = catalog.list_checkpoints(s3_prefix, include_uncommitted=True, **s3_options)
    foreign = [i for i in everything if i.foreign]
    assert [(i.name, i.committed, i.save_id) for i in foreign] == [("step-2", False, None)]
    assert list(catalog.committed_names(s3_prefix, **s3_options)) == ["step-1"]
    report = catalog.prune(s3_prefix, keep_last=1, **s3_options)
    assert [d.name for d in report.decisions] == ["step-1"] and report.removed == []
    raw.intact({"step-2/manifest.json": FOREIGN_MANIFESTS["json/step-2"]})


def test_an_object_another_tool_wrote_over_a_listed_key_keeps_its_checkpoint(
    s3ckpt, local_s3, s3_prefix, make_writer
):
    """rm and prune delete the objects a manifest lists only while they are the ones its
    save wrote: one another tool replaced (same key, same size, other bytes) is not
    deleted, nor is anything of its checkpoint; the others go as usual."""
    raw = Raw(local_s3, s3_prefix)
    for step in (1, 2):
        _save(make_writer, f"{s3_prefix}/step-{step}", float(step))
    (data,) = [k for k in raw.keys("step-1/data/")]
    theirs = bytes(255 - b for b in raw.get(data))
    raw.put(data, theirs)
    step1 = {rel: raw.get(rel) for rel in raw.keys("step-1/")}

    refused = s3ckpt("rm", f"{s3_prefix}/step-1")
    assert refused.code == 1 and refused.err.count("\n") == 1, refused.err
    assert f"{s3_prefix}/{data} is not the object its manifest recorded (ETag " in refused.err
    assert "not s3ckpt's" in refused.err
    pruned = s3ckpt("prune", s3_prefix, "--keep-last", "0", "--force", "--json")
    assert pruned.code == 1 and [d["name"] for d in pruned.json()["deleted"]] == ["step-2"]
    assert pruned.json()["changed"] == ["step-1"] and "not s3ckpt's" in pruned.err
    dead = ["--older-than", "0s", "--force", "--in-flight-lease", "0s", "--json"]
    assert s3ckpt("gc", s3_prefix, *dead).json()["objects"] == 0
    raw.intact(step1)
    assert raw.keys() == set(step1)


def test_import_never_writes_over_a_foreign_manifest(s3ckpt, local_s3, s3_prefix, tmp_path):
    raw = Raw(local_s3, s3_prefix)
    raw.put("step-2/manifest.json", FOREIGN_MANIFESTS["other/step-2"])
    source = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(8)}, source)
    for extra in ((), ("--overwrite",)):
        result = s3ckpt("import", str(source), f"{s3_prefix}/step-2", *extra)
        assert result.code == 1 and result.err.count("\n") == 1, result.err
    assert "is not s3ckpt's" in result.err  # with --overwrite: named as foreign
    raw.intact({"step-2/manifest.json": FOREIGN_MANIFESTS["other/step-2"]})
    assert raw.keys() == {"step-2/manifest.json"}


def test_a_save_never_writes_over_a_foreign_manifest(local_s3, s3_prefix, s3_options, make_writer):
    """dcp.save, with overwrite=True or not, and CheckpointManager.save refuse a location
    whose manifest.json is another tool's with ForeignObjectError, before writing anything."""
    from torch.distributed.checkpoint import CheckpointException

    import s3ckpt
    from s3ckpt import catalog

    raw = Raw(local_s3, s3_prefix)
    theirs = {
        "step-2/manifest.json": FOREIGN_MANIFESTS["other/step-2"],
        f"{s3ckpt.step_name(7)}/manifest.json": FOREIGN_MANIFESTS["json/step-2"],
    }
    for rel, body in theirs.items():
        raw.put(rel, body)
    for overwrite in (False, True):
        with pytest.raises(CheckpointException) as raised:
            _save(make_writer, f"{s3_prefix}/step-2", overwrite=overwrite)
        error = s3ckpt.unwrap(raised.value)
        assert isinstance(error, s3ckpt.ForeignObjectError), (overwrite, error)
        assert str(error).startswith(f"{s3_prefix}/step-2/manifest.json is not s3ckpt's")
    assert not catalog.is_committed(f"{s3_prefix}/step-2", **s3_options)

    state = {"w": torch.full((64,), 7.0)}
    with s3ckpt.CheckpointManager(s3_prefix, async_mode="sync", **s3_options) as manager:
        for step, overwrite in ((7, False), (7, True)):
            manager.overwrite = overwrite
            with pytest.raises(s3ckpt.ForeignObjectError, match="is not s3ckpt's"):
                manager.save(step, state)
        assert manager.steps() == []
    raw.intact(theirs)
    assert raw.keys() == set(theirs)  # no object of any save: nothing was written


LATEST = """\
import json, logging, sys, warnings

import torch

import s3ckpt

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
state = {"w": torch.zeros(64), "step": 0}
with s3ckpt.CheckpointManager(sys.argv[1], async_mode="sync") as manager:
    first = manager.steps()
    loaded = manager.load_latest(state)
    print(json.dumps({"steps": first, "again": manager.steps(), "loaded": loaded,
                      "value": float(state["w"][0]), "uri": manager.uri_of(loaded)}))
"""


def test_a_fresh_manager_skips_a_foreign_step_folder_and_says_why(
    local_s3, s3_prefix, s3_options, make_writer, tmp_path
):
    """A run holding another tool's step-0000000005/manifest.json and a real step 3: a
    manager in a fresh process lists step 3 only, loads it, and logs the reason once."""
    import s3ckpt
    from s3ckpt import catalog

    raw = Raw(local_s3, s3_prefix)
    foreign = f"{s3ckpt.step_name(5)}/manifest.json"
    raw.put(foreign, FOREIGN_MANIFESTS["other/step-2"])
    _save(make_writer, f"{s3_prefix}/{s3ckpt.step_name(3)}", 3.0)
    env = {**os.environ, **local_s3.env()}
    env["AWS_CONFIG_FILE"] = env["AWS_SHARED_CREDENTIALS_FILE"] = str(tmp_path / "none")
    script = tmp_path / "latest.py"
    script.write_text(textwrap.dedent(LATEST))
    done = subprocess.run(
        [sys.executable, str(script), s3_prefix],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found == {
        "steps": [3],
        "again": [3],
        "loaded": 3,
        "value": 3.0,
        "uri": f"{s3_prefix}/{s3ckpt.step_name(3)}",
    }
    why = f"{s3_prefix}/{foreign} is not s3ckpt's"
    noted = [line for line in done.stderr.splitlines() if why in line]
    assert len(noted) == 1, done.stderr[-3000:]  # once per manager, at INFO
    assert noted[0].startswith("INFO ") and noted[0].endswith("not used as a step"), noted

    listed = catalog.run_steps(s3_prefix, **s3_options)
    assert listed.names == {3: s3ckpt.step_name(3)} and listed.latest() == 3
    assert [n.name for n in listed.notes] == [s3ckpt.step_name(5)]
    assert not catalog.is_committed(f"{s3_prefix}/{s3ckpt.step_name(5)}", **s3_options)
    assert catalog.is_committed(f"{s3_prefix}/{s3ckpt.step_name(3)}", **s3_options)
    raw.intact({foreign: FOREIGN_MANIFESTS["other/step-2"]})
