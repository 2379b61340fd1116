from s3ckpt.layout import StoredItem, plan_objects


def test_items_are_packed_in_order_into_few_objects():
    items = [(f"t{i}", 1000) for i in range(500)]
    objects = plan_objects(items, rank=3, save_id="abc", max_object_size=100_000)
    assert len(objects) == 5
    assert objects[0].key == "data/r00003-abc-0000.bin"
    offsets = [slot.offset for slot in objects[0].slots]
    assert offsets == list(range(0, 100_000, 1000))
    assert [s.index for o in objects for s in o.slots] == [f"t{i}" for i in range(500)]


def test_an_item_larger_than_the_limit_gets_its_own_object():
    objects = plan_objects(
        [("a", 10), ("big", 500), ("b", 10)], rank=0, save_id="s", max_object_size=100
    )
    assert [[s.index for s in o.slots] for o in objects] == [["a"], ["big"], ["b"]]
    assert objects[1].size == 500


def test_block_span_widens_to_whole_checksum_blocks():
    item = StoredItem("k", 0, 100, (1, 2, 3, 4), block_size=30)
    assert item.block_span(0, 100) == (0, 100)
    assert item.block_span(31, 59) == (30, 60)
    assert item.block_span(95, 100) == (90, 100)
    assert StoredItem("k", 0, 0, (0,)).block_span(0, 0) == (0, 0)
