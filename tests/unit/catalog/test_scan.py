"""Grouping a listing into checkpoints, from object names alone."""

from __future__ import annotations

from datetime import datetime, timezone

from s3ckpt.catalog.scan import data_directory, group_keys
from s3ckpt.s3.store import ObjectMeta


def meta(key: str, size: int = 10, at: float = 1000.0) -> ObjectMeta:
    return ObjectMeta(key, size, '"etag"', datetime.fromtimestamp(at, tz=timezone.utc))


def test_keys_are_grouped_by_checkpoint_directory():
    scan = group_keys(
        "run",
        [
            meta("run/step-1/manifest.json", 5, at=1010),
            meta("run/step-1/metadata-aaaa.pkl", 7, at=1009),
            meta("run/step-1/data/r00000-aaaa-0000.bin", 100),
            meta("run/step-1/data/r00001-aaaa-0000.bin", 100),
            meta("run/a/b/data/r00000-bbbb-0000.bin", 50, at=2000),
            meta("run/a/b/.s3ckpt-probe-0123abcd"),
            meta("run/notes.txt"),
            meta("run/step-1/data/readme.md"),
        ],
    )
    assert set(scan.groups) == {"step-1", "a/b"}
    step1, ab = scan.groups["step-1"], scan.groups["a/b"]
    assert step1.committed and step1.bytes == 212 and step1.newest == 1010
    assert step1.committed_save_hint() == "aaaa" and step1.ranks("aaaa") == 2
    assert not ab.committed and ab.bytes == 50 and ab.newest == 2000
    assert [p.key for p in scan.probes] == ["run/a/b/.s3ckpt-probe-0123abcd"]


def test_the_prefix_itself_can_be_a_checkpoint_and_the_bucket_root_a_prefix():
    scan = group_keys("run/step-1", [meta("run/step-1/manifest.json")])
    assert set(scan.groups) == {""}
    scan = group_keys("", [meta("x/manifest.json"), meta("data/r00000-aaaa-0000.bin")])
    assert set(scan.groups) == {"x", ""}


def test_the_committed_save_is_guessed_from_the_newest_metadata_before_the_commit():
    scan = group_keys(
        "p",
        [
            meta("p/c/manifest.json", at=500),
            meta("p/c/metadata-0001.pkl", at=100),  # an older save, overwritten
            meta("p/c/metadata-0002.pkl", at=499),  # the committed one
            meta("p/c/metadata-0003.pkl", at=900),  # a later overwrite that never committed
            meta("p/c/data/r00000-0002-0000.bin"),
            meta("p/c/data/r00000-0003-0000.bin"),
            meta("p/c/data/r00001-0003-0000.bin"),
        ],
    )
    group = scan.groups["c"]
    assert group.committed_save_hint() == "0002"
    assert group.ranks("0002") == 1 and group.save_ids() == {"0001", "0002", "0003"}


def test_data_directory():
    assert data_directory("step-1/data/r00000-ab12-0000.bin") == "step-1"
    assert data_directory("data/r00003-ab12-0007.bin") == ""
    assert data_directory("step-1/data/other.bin") is None
    assert data_directory("step-1/data/a/r00000-ab12-0000.bin") == "step-1"  # spread prefixes
    assert data_directory("run/step-2/data/3f0/r00001-ab12-0001.bin") == "run/step-2"
    assert data_directory("step-1/data/xyz/r00000-ab12-0000.bin") is None
    assert data_directory("step-1/metadata-ab12.pkl") is None


class _MemoryStore:
    """ListObjectsV2 semantics over a set of keys (1000 per page), counting requests."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = sorted(keys)
        self.requests: list[tuple[str, str | None]] = []

    async def list(self, prefix: str):
        under = [k for k in self.keys if k.startswith(prefix)]
        for page in range(0, max(len(under), 1), 1000):
            self.requests.append((prefix, None))
            for key in under[page : page + 1000]:
                yield meta(key)

    async def list_level(self, prefix: str):
        self.requests.append((prefix, "/"))
        folders: list[str] = []
        for key in self.keys:
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix) :]
            if "/" in rest:
                folder = prefix + rest.split("/", 1)[0] + "/"
                if folder not in folders:
                    folders.append(folder)
                    yield folder
            else:
                yield meta(key)


def _checkpoint(name: str, save: str, ranks: int, committed: bool = True) -> list[str]:
    keys = [f"{name}/metadata-{save}.pkl"] + ([f"{name}/manifest.json"] if committed else [])
    for rank in range(ranks):
        keys += [
            f"{name}/data/r{rank:05d}-{save}-0000.bin",
            f"{name}/index/r{rank:05d}-{save}.json",
        ]
    return keys


def test_scan_checkpoints_lists_large_runs_by_level_never_entering_committed_data():
    import asyncio

    from s3ckpt.catalog.scan import scan_checkpoints
    from s3ckpt.config import S3URI

    keys = [
        *_checkpoint("run/step-1", "aaaa", 600),
        *_checkpoint("run/step-2", "bbbb", 600),
        *_checkpoint("run/nested/step-3", "cccc", 2),
        *_checkpoint("run/step-4", "dddd", 3, committed=False),  # a save in flight
        "run/step-4/.s3ckpt-saving-dddd",
        "run/notes.txt",
    ]
    store = _MemoryStore(keys)
    scan = asyncio.run(scan_checkpoints(store, S3URI.parse("s3://bucket/run")))  # type: ignore[arg-type]
    assert set(scan.groups) == {"step-1", "step-2", "nested/step-3", "step-4"}
    for name in ("step-1", "step-2", "nested/step-3"):
        group = scan.groups[name]
        assert group.committed and group.shallow and len(group.objects) == 1  # the metadata
    in_flight = scan.groups["step-4"]
    assert not in_flight.committed and not in_flight.shallow
    assert len(in_flight.objects) == 7 and len(in_flight.saving) == 1  # listed in full
    # One page of the recursive listing, then one request per directory; data/ and index/
    # of committed checkpoints are never listed (2,400 of their objects).
    assert store.requests[0] == ("run/", None)
    assert sorted(store.requests[1:], key=str) == [
        ("run/", "/"),
        ("run/nested/", "/"),
        ("run/nested/step-3/", "/"),
        ("run/step-1/", "/"),
        ("run/step-2/", "/"),
        ("run/step-4/", "/"),
        ("run/step-4/", None),  # no manifest: listed in full
    ]


def test_scan_checkpoints_takes_one_request_for_small_runs():
    import asyncio

    from s3ckpt.catalog.scan import scan_checkpoints
    from s3ckpt.config import S3URI

    store = _MemoryStore(
        _checkpoint("run/step-1", "aaaa", 4) + _checkpoint("run/step-2", "bbbb", 4)
    )
    scan = asyncio.run(scan_checkpoints(store, S3URI.parse("s3://bucket/run")))  # type: ignore[arg-type]
    assert set(scan.groups) == {"step-1", "step-2"} and store.requests == [("run/", None)]
    assert not scan.groups["step-1"].shallow and len(scan.groups["step-1"].objects) == 9
