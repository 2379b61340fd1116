import json
import pickle

import pytest

from s3ckpt.errors import CorruptCheckpointError, ForeignObjectError
from s3ckpt.format.layout import StoredItem, index_key
from s3ckpt.format.manifest import (
    FORMAT_VERSION,
    IndexRef,
    ItemEntry,
    Manifest,
    ObjectEntry,
    sealed,
)
from s3ckpt.format.rank_index import ItemOwners, RankIndex

KEY = "data/r00000-abc-0000.bin"


def _item(fqn: str = "w", offsets: tuple[int, ...] = (0, 0)) -> ItemEntry:
    stored = StoredItem(KEY, 0, 100, (42,), 8 << 20, "raw", '"etag"')
    return ItemEntry(fqn, offsets, "tensor", "float32", (5, 5), stored)


def _manifest(version: int = FORMAT_VERSION) -> Manifest:
    """A format-1 manifest lists its items; a format-2 one lists index objects."""
    v1 = version == 1
    return Manifest(
        save_id="abc",
        world_size=2,
        metadata_key="metadata-abc.pkl",
        metadata_size=10,
        metadata_crc32c=123,
        objects=(ObjectEntry(KEY, 100, '"etag"', 0),),
        items=(_item(),) if v1 else (),
        version=version,
        indexes=() if v1 else (IndexRef(0, index_key(0, "abc"), 7, 99, 1),),
    )


@pytest.mark.parametrize("version", [1, FORMAT_VERSION])
def test_manifest_round_trips_through_json(version):
    manifest = _manifest(version)
    assert Manifest.from_json(manifest.to_json(), "m") == manifest
    raw = json.loads(manifest.to_json())
    assert raw["format"] == "s3ckpt" and raw["version"] == version
    assert raw["total_bytes"] == (110 if version == 1 else 117)


def test_the_manifest_of_a_save_names_its_metadata_object_by_key_size_and_crc():
    from crc32c import crc32c

    from s3ckpt import __version__
    from s3ckpt.format.layout import metadata_key

    objects = (ObjectEntry(KEY, 100, '"etag"', 0),)
    indexes = (IndexRef(0, index_key(0, "abc"), 7, 99, 1),)
    manifest = Manifest.of_save("abc", 2, b"pickled", objects, indexes, torch_version="2.x")
    assert (manifest.metadata_key, manifest.metadata_size) == (metadata_key("abc"), 7)
    assert manifest.metadata_crc32c == crc32c(b"pickled")
    assert (manifest.objects, manifest.indexes, manifest.items) == (objects, indexes, ())
    assert (manifest.save_id, manifest.world_size, manifest.version) == ("abc", 2, FORMAT_VERSION)
    assert (manifest.torch_version, manifest.s3ckpt_version) == ("2.x", __version__)
    assert Manifest.from_json(manifest.to_json(), "m") == manifest


def test_format_2_manifest_lists_index_objects_not_items():
    manifest = _manifest()
    raw = json.loads(manifest.to_json())
    assert "items" not in raw
    assert raw["indexes"] == [
        {"rank": 0, "key": "index/r00000-abc.json", "size": 7, "crc32c": 99, "items": 1}
    ]
    assert manifest.all_keys() == [KEY, "index/r00000-abc.json", "metadata-abc.pkl"]
    assert manifest.item_count == 1 and not manifest.items_listed


def test_manifest_size_grows_with_ranks_not_items():
    """Format 2's commit record: a few hundred bytes per rank, whatever the item count."""
    ranks = 64
    manifest = Manifest(
        save_id="0123456789abcdef",
        world_size=ranks,
        metadata_key="metadata-0123456789abcdef.pkl",
        metadata_size=10,
        metadata_crc32c=1,
        objects=tuple(
            ObjectEntry(
                f"data/r{r:05d}-0123456789abcdef-0000.bin", 1 << 40, '"' + "f" * 32 + '"', r
            )
            for r in range(ranks)
        ),
        items=(),
        indexes=tuple(
            IndexRef(r, index_key(r, "0123456789abcdef"), 1 << 30, 4294967295, 1_000_000)
            for r in range(ranks)
        ),
    )
    assert len(manifest.to_json()) / ranks < 2048


@pytest.mark.parametrize(
    "mutate",
    [
        lambda raw: raw.update(format="other"),
        lambda raw: raw.update(version=FORMAT_VERSION + 1),
        lambda raw: raw.pop("objects"),
        lambda raw: raw["items"][0].pop("crc32c"),
    ],
)
def test_unreadable_manifests_raise_corrupt_checkpoint_error(mutate):
    raw = json.loads(_manifest(1).to_json())
    mutate(raw)
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_json(json.dumps(raw).encode(), "s3://b/m")


def test_unreadable_index_list_is_corrupt():
    raw = json.loads(_manifest().to_json())
    raw["indexes"][0].pop("crc32c")
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_json(json.dumps(raw).encode(), "s3://b/m")


def test_garbage_is_foreign_and_a_damaged_manifest_corrupt():
    with pytest.raises(ForeignObjectError, match="s3://b/m is not s3ckpt's"):
        Manifest.from_json(b"\x00not json", "s3://b/m")
    with pytest.raises(ForeignObjectError):
        Manifest.from_json(b"[]", "s3://b/m")
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_json(_manifest(1).to_json()[:-9], "s3://b/m")
    with pytest.raises(CorruptCheckpointError, match="index object"):
        RankIndex.from_json(b"[]", "s3://b/i", {})


def test_items_are_flat_json_objects_and_unknown_fields_are_ignored_everywhere():
    manifest = _manifest(1)
    raw = json.loads(manifest.to_json())
    item = raw["items"][0]
    assert item["key"] == KEY and item["crc32c"] == [42]
    assert "stored" not in item and "etag" not in item
    item["added_by_a_newer_release"] = 1
    raw["objects"][0]["added_by_a_newer_release"] = 2
    raw["added_by_a_newer_release"] = 3
    del raw["manifest_crc32c"]  # a writer seals what it writes
    parsed = Manifest.from_json(sealed(json.dumps(raw).encode()), "m")
    assert parsed.items[0].stored.etag == '"etag"'  # the object's, from the object list
    assert parsed == manifest


def test_rank_index_round_trips_and_takes_etags_from_the_manifest():
    index = RankIndex("abc", 3, (_item("w", (0, 0)), _item("w", (5, 0))))
    raw = json.loads(index.to_json())
    assert raw["format"] == "s3ckpt-index" and "etag" not in raw["items"][0]
    raw["added_by_a_newer_release"] = 1
    parsed = RankIndex.from_json(json.dumps(raw).encode(), "i", {KEY: '"etag"'})
    assert parsed == index
    assert set(parsed.by_index()) == {("w", (0, 0)), ("w", (5, 0))}


def test_item_owners_map_chunk_positions_to_ranks_and_pickle_small():
    owners = ItemOwners.build({"w": 3, "step": 1}, [("w", 0, 0), ("w", 2, 7), ("step", 0, 1)])
    assert owners.rank_of("w", 0) == 0 and owners.rank_of("w", 2) == 7
    assert owners.rank_of("step", 0) == 1
    for missing in [("w", 1), ("w", 3), ("other", 0)]:
        with pytest.raises(KeyError):
            owners.rank_of(*missing)
    many = ItemOwners.build({"w": 100_000}, [("w", i, i % 1024) for i in range(100_000)])
    assert len(pickle.dumps(many, protocol=4)) < 4 * 100_000 + 200


def test_a_flipped_bit_anywhere_in_a_manifest_is_caught_before_it_is_parsed():
    """The manifest carries the CRC32C of its own bytes: every single-bit flip, in the
    body, in the checksum or in its name, is refused as damage."""
    body = _manifest().to_json()
    assert body.startswith(b'{"manifest_crc32c":')
    assert Manifest.from_json(body, "m") == Manifest.from_json(body, "m")
    for position in range(len(body)):
        for bit in (0, 5):
            damaged = bytearray(body)
            damaged[position] ^= 1 << bit
            with pytest.raises(CorruptCheckpointError):
                Manifest.from_json(bytes(damaged), "m")


def test_a_manifest_written_before_the_seal_still_reads():
    sealed_body = _manifest().to_json()
    raw = json.loads(sealed_body)
    del raw["manifest_crc32c"]
    legacy = json.dumps(raw, separators=(",", ":")).encode()
    assert legacy.startswith(b'{"format":')
    assert Manifest.from_json(legacy, "m") == Manifest.from_json(sealed_body, "m")
