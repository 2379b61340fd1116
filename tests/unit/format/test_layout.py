from s3ckpt.format.layout import StoredItem, data_key


def test_data_keys_carry_rank_and_save_id():
    assert data_key(3, "abc", 0) == "data/r00003-abc-0000.bin"


def test_block_span_widens_to_whole_checksum_blocks():
    item = StoredItem("k", 0, 100, (1, 2, 3, 4), block_size=30)
    assert item.block_span(0, 100) == (0, 100)
    assert item.block_span(31, 59) == (30, 60)
    assert item.block_span(95, 100) == (90, 100)
    assert StoredItem("k", 0, 0, (0,)).block_span(0, 0) == (0, 0)


def test_compressed_items_map_raw_blocks_to_stored_frames():
    item = StoredItem(
        "k",
        0,
        60,
        (1, 2, 3, 4),
        block_size=30,
        codec="zstd",
        raw_length=100,
        frames=(10, 20, 25, 5),
    )
    assert item.size == 100
    assert item.block_span(31, 59) == (30, 60)
    assert item.stored_span(30, 60) == (10, 30)
    assert item.stored_span(0, 100) == (0, 60)
    assert item.stored_span(90, 100) == (55, 60)


def test_spread_data_keys_use_that_many_hashed_prefixes():
    from s3ckpt.format.layout import data_key

    assert data_key(3, "ab12", 7) == "data/r00003-ab12-0007.bin"
    for spread, width in ((16, 1), (256, 2), (4096, 3)):
        keys = {data_key(rank, "ab12", n, spread) for rank in range(64) for n in range(4)}
        prefixes = {k.split("/")[1] for k in keys}
        assert all(len(p) == width for p in prefixes)
        assert len(prefixes) > min(spread, 256) // 4  # spread out, not clustered
    assert data_key(3, "ab12", 7, 256) == data_key(3, "ab12", 7, 256)  # deterministic


def test_a_ranks_data_objects_are_told_apart_from_others():
    from s3ckpt.format.layout import data_key, index_key, is_rank_data

    for spread in (0, 16, 256, 4096):
        assert is_rank_data(data_key(3, "abc", 7, spread), 3)
        assert not is_rank_data(data_key(13, "abc", 7, spread), 3)
        assert not is_rank_data(index_key(3, "abc", spread), 3)
    assert not is_rank_data("manifest.json", 0)
