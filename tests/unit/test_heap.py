import gc

import pytest

from s3ckpt.heap import frozen_heap


@pytest.fixture(autouse=True)
def _collector_restored():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    if enabled:
        gc.enable()


def test_existing_objects_are_frozen_only_inside_the_block():
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_the_freeze_is_undone_when_the_block_raises():
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("load failed")
    assert gc.get_freeze_count() == 0


def test_an_applications_own_freeze_is_left_alone():
    gc.freeze()
    frozen = gc.get_freeze_count()
    with frozen_heap():
        pass
    assert gc.get_freeze_count() == frozen


def test_a_disabled_collector_is_left_alone():
    gc.disable()
    with frozen_heap():
        assert gc.get_freeze_count() == 0
    assert not gc.isenabled()


def test_cycles_made_inside_the_block_are_still_collected():
    class Node:
        pass

    with frozen_heap():
        node = Node()
        node.self = node
        del node
        assert gc.collect() >= 1
