import pytest

from s3ckpt.transfer.parts import (
    DEFAULT_PART_SIZE,
    MAX_PART_SIZE,
    MAX_PARTS,
    MIN_PART_SIZE,
    MiB,
    PartCutter,
    Piece,
    TiB,
    choose_part_size,
    part_limits,
)


def cut_parts(
    lengths: list[int], part_size: int, min_part: int = MIN_PART_SIZE, align: int = 1
) -> list[list[Piece]]:
    """All parts for ``lengths`` at once, fed to a :class:`PartCutter` item by item."""
    cutter = PartCutter(part_size, min_part, align)
    parts = [part for item, length in enumerate(lengths) for part in cutter.add(item, length)]
    return parts + cutter.finish()


def test_default_part_size_for_ordinary_objects():
    assert choose_part_size(1024 * MiB) == DEFAULT_PART_SIZE


def test_preferred_size_is_clamped_to_s3_limits():
    assert choose_part_size(100 * MiB, 1) == MIN_PART_SIZE
    assert choose_part_size(100 * MiB, 10 * 1024 * MiB) == MAX_PART_SIZE


@pytest.mark.parametrize("size", [MAX_PARTS * DEFAULT_PART_SIZE + 1, 3 * TiB, 5 * TiB])
def test_huge_objects_stay_within_ten_thousand_parts(size):
    part = choose_part_size(size)
    assert MIN_PART_SIZE <= part <= MAX_PART_SIZE
    assert -(-size // part) <= MAX_PARTS


def test_objects_beyond_five_tib_are_refused():
    with pytest.raises(ValueError):
        choose_part_size(5 * TiB + 1)


def _check_cut(lengths, part_size, min_part=MIN_PART_SIZE, align=1):
    parts = cut_parts(lengths, part_size, min_part, align)
    flat = [piece for part in parts for piece in part]
    # every byte of every item exactly once, in order
    position = {i: 0 for i in range(len(lengths))}
    order = []
    for item, start, end in flat:
        assert start == position[item]
        position[item] = end
        order.append(item)
    assert {i: n for i, n in position.items() if lengths[i]} == {
        i: n for i, n in enumerate(lengths) if n
    }
    assert order == sorted(order)
    sizes = [sum(end - start for _, start, end in part) for part in parts]
    assert all(size >= min_part for size in sizes[:-1]), sizes
    assert len(parts) <= MAX_PARTS
    return parts, sizes


def test_large_items_get_parts_of_their_own_split_evenly():
    parts, sizes = _check_cut([100 * MiB, 6 * MiB, 40 * MiB], 16 * MiB)
    assert all(len(part) == 1 for part in parts)  # nothing joined
    assert sizes[:7] == [100 * MiB // 7 + (1 if i < 100 * MiB % 7 else 0) for i in range(7)]
    assert sizes[7] == 6 * MiB


def test_small_items_share_parts_and_small_tails_are_topped_up():
    parts, sizes = _check_cut([MiB] * 34 + [30 * MiB], 16 * MiB)
    assert [len(part) for part in parts[:2]] == [16, 16]  # 16 x 1 MiB in each joined part
    # The 2 MiB of small items left are too few to close a part: the large item tops
    # them up to the minimum, and the rest of it gets parts of its own.
    assert parts[2] == [(32, 0, MiB), (33, 0, MiB), (34, 0, MIN_PART_SIZE - 2 * MiB)]
    assert all(len(part) == 1 and part[0][0] == 34 for part in parts[3:])
    assert max(sizes) <= 16 * MiB


def test_empty_items_are_kept_and_never_make_an_empty_last_part():
    _parts, sizes = _check_cut([0, 20 * MiB, 0, 0], 16 * MiB)
    assert sizes[-1] > 0
    assert sum(sizes) == 20 * MiB


@pytest.mark.parametrize("seed", range(20))
def test_random_layouts_stay_within_s3_limits(seed):
    import random

    rng = random.Random(seed)
    lengths = [
        rng.choice([0, 1, 1000, MiB, 3 * MiB, 5 * MiB, 17 * MiB, 70 * MiB])
        for _ in range(rng.randint(1, 60))
    ]
    _check_cut(lengths, rng.choice([5, 8, 16, 64]) * MiB)


def test_part_limits_keep_huge_objects_within_ten_thousand_parts():
    lengths = [MIN_PART_SIZE] * (MAX_PARTS + 5)
    part_size, min_part = part_limits(sum(lengths))
    assert min_part > MIN_PART_SIZE
    parts, _sizes = _check_cut(lengths, part_size, min_part)
    assert len(parts) <= MAX_PARTS
    assert part_limits(1024 * MiB) == (DEFAULT_PART_SIZE, MIN_PART_SIZE)


@pytest.mark.parametrize(
    "lengths",
    [[int(153.6 * MiB)], [3 * MiB, 100 * MiB + 17], [20 * MiB], [1000, 64 * MiB, 5 * MiB + 1]],
)
def test_cuts_inside_an_item_sit_on_checksum_blocks_when_asked(lengths):
    block = 8 * MiB
    parts, _ = _check_cut(lengths, 16 * MiB, align=block)
    for part in parts:
        for item, start, end in part:
            if len(part) == 1:  # a part of its own: its inner cuts are block-aligned
                assert start % block == 0 or start == parts_start(parts, item)
                assert end % block == 0 or end == lengths[item]


def parts_start(parts, item):
    """Where the item's first part of its own starts (after topping up a shared part)."""
    return min(start for part in parts for i, start, _ in part if i == item and len(part) == 1)


@pytest.mark.parametrize("native", [True, False], ids=["c-helper", "ctypes-fallback"])
def test_packed_parts_are_joined_byte_for_byte(native, monkeypatch):
    """A part packed from several items is one copy of their bytes, in order, whether the
    items' memory is writable (joined with the GIL released) or not, by the C helper and
    by its fallback alike."""
    import os

    from s3ckpt.transfer import parts as part_module
    from s3ckpt.transfer.parts import join as _join

    if native:
        assert part_module._gather is not None, "the C helper s3ckpt.transfer._gather is not built"
    else:
        monkeypatch.setattr(part_module, "_gather", None)

    a, b = bytearray(os.urandom(100_000)), bytearray(os.urandom(3))
    pieces = [memoryview(a)[10:50_000], memoryview(b), memoryview(bytearray()), memoryview(a)[:7]]
    joined = _join(pieces)
    assert isinstance(joined, bytes) and joined == b"".join(pieces)
    assert _join([memoryview(b"xy"), memoryview(b"z")]) == b"xyz"  # read-only pieces
    single = memoryview(a)[5:9]
    assert _join([single]) is single  # one piece: no copy at all
