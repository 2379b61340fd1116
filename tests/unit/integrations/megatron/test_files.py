"""The torch-only pieces of the Megatron file layer: paths, tracker contents, item names,
and an ``s3://`` file that is only stored when it is closed without an error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from s3ckpt.config import S3URI
from s3ckpt.errors import ConfigError
from s3ckpt.integrations.megatron import files


def test_s3_paths_also_as_pathlib_makes_them() -> None:
    assert files.is_s3("s3://ckpt/run/iter_0000001")
    assert files.is_s3(Path("s3://ckpt/run/iter_0000001"))  # pathlib: s3:/b/run/...
    assert not files.is_s3("/data/run") and not files.is_s3(None)
    assert files.s3_uri(Path("s3://ckpt/run/iter_0000001/")) == S3URI("ckpt", "run/iter_0000001")
    assert files.parent_of(S3URI("ckpt", "run/iter_0000001")) == S3URI("ckpt", "run")


def test_tracker_contents_name_a_step_directory() -> None:
    assert files.step_name("100\n") == "iter_0000100"
    assert files.step_name("release") == "release"
    with pytest.raises(ConfigError, match="names a step or 'release'"):
        files.step_name("latest")


def test_item_names_parse_as_megatron_object_keys() -> None:
    key = files.member_key(files.COMMON)
    name, shard = key.split("/")  # what ShardedObject.empty_from_unique_key splits
    assert shard.split("_") == ["shard", "0", "1"] and "/" not in name
    assert files.is_member_key(key) and not files.is_member_key("layer.weight")


class _Recorder:
    def __init__(self) -> None:
        self.written: list[tuple[str, bytes]] = []

    def write(self, uri: S3URI, data: bytes) -> None:
        self.written.append((str(uri), data))


def test_a_file_is_stored_on_close_and_not_after_an_error() -> None:
    recorder: Any = _Recorder()
    uri = S3URI("ckpt", "run/latest_checkpointed_iteration.txt")
    with files._Upload(recorder, uri, binary=False) as f:
        f.write("12")
    assert recorder.written == [(str(uri), b"12")]
    with pytest.raises(RuntimeError), files._Upload(recorder, uri, binary=False) as f:
        f.write("13")
        raise RuntimeError("the writer failed")
    assert len(recorder.written) == 1
