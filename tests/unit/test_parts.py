import itertools

import pytest

from s3ckpt.parts import (
    DEFAULT_PART_SIZE,
    MAX_PART_SIZE,
    MAX_PARTS,
    MIN_PART_SIZE,
    MiB,
    TiB,
    choose_part_size,
    is_multipart,
    part_ranges,
)


def test_default_part_size_for_ordinary_objects():
    assert choose_part_size(1024 * MiB) == DEFAULT_PART_SIZE


def test_preferred_size_is_clamped_to_s3_limits():
    assert choose_part_size(100 * MiB, 1) == MIN_PART_SIZE
    assert choose_part_size(100 * MiB, 10 * 1024 * MiB) == MAX_PART_SIZE


@pytest.mark.parametrize("size", [MAX_PARTS * DEFAULT_PART_SIZE + 1, 3 * TiB, 5 * TiB])
def test_huge_objects_stay_within_ten_thousand_parts(size):
    part = choose_part_size(size)
    assert MIN_PART_SIZE <= part <= MAX_PART_SIZE
    assert len(part_ranges(size, part)) <= MAX_PARTS


def test_objects_beyond_five_tib_are_refused():
    with pytest.raises(ValueError):
        choose_part_size(5 * TiB + 1)


def test_part_ranges_cover_the_object_exactly():
    ranges = part_ranges(50 * MiB + 3, 16 * MiB)
    assert ranges[0] == (0, 16 * MiB)
    assert ranges[-1] == (48 * MiB, 50 * MiB + 3)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_small_objects_are_single_puts():
    assert not is_multipart(16 * MiB, 16 * MiB)
    assert is_multipart(16 * MiB + 1, 16 * MiB)
