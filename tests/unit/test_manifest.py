import json

import pytest

from s3ckpt.errors import CorruptCheckpointError
from s3ckpt.format.layout import StoredItem
from s3ckpt.format.manifest import FORMAT_VERSION, ItemEntry, Manifest, ObjectEntry


def _manifest() -> Manifest:
    return Manifest(
        save_id="abc",
        world_size=2,
        metadata_key="metadata-abc.pkl",
        metadata_size=10,
        metadata_crc32c=123,
        objects=(ObjectEntry("data/r00000-abc-0000.bin", 100, '"etag"', 0),),
        items=(
            ItemEntry(
                "w",
                (0, 0),
                "tensor",
                "float32",
                (5, 5),
                StoredItem("data/r00000-abc-0000.bin", 0, 100, (42,), 8 << 20, "raw", '"etag"'),
            ),
        ),
    )


def test_manifest_round_trips_through_json():
    manifest = _manifest()
    assert Manifest.from_json(manifest.to_json(), "m") == manifest
    raw = json.loads(manifest.to_json())
    assert raw["format"] == "s3ckpt" and raw["version"] == FORMAT_VERSION
    assert raw["total_bytes"] == 110


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
    raw = json.loads(_manifest().to_json())
    mutate(raw)
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_json(json.dumps(raw).encode(), "s3://b/m")


def test_garbage_is_corrupt():
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_json(b"\x00not json", "s3://b/m")


def test_items_are_flat_json_objects_and_unknown_fields_are_ignored_everywhere():
    manifest = _manifest()
    raw = json.loads(manifest.to_json())
    item = raw["items"][0]
    assert item["key"] == "data/r00000-abc-0000.bin" and item["crc32c"] == [42]
    assert "stored" not in item and "etag" not in item
    item["added_by_a_newer_release"] = 1
    raw["objects"][0]["added_by_a_newer_release"] = 2
    raw["added_by_a_newer_release"] = 3
    parsed = Manifest.from_json(json.dumps(raw).encode(), "m")
    assert parsed.items[0].stored.etag == '"etag"'  # the object's, from the object list
    assert parsed == manifest
