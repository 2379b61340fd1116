"""restore.FramePool: receive buffers for compressed frames, reused by size class."""

from s3ckpt.dcp.restore import FramePool

MiB = 1024 * 1024


def test_buffers_are_reused_by_size_class():
    pool = FramePool()
    first = pool.take(3 * MiB + 5)
    assert 3 * MiB + 5 <= first.nbytes <= (3 * MiB + 5) * 1.13
    pool.give(first)
    again = pool.take(3 * MiB + 100)  # same class: the same memory
    assert again.ctypes.data == first.ctypes.data
    assert pool.take(3 * MiB + 100).ctypes.data != first.ctypes.data  # taken: a new one


def test_small_buffers_are_exact_and_not_kept():
    pool = FramePool()
    small = pool.take(1000)
    assert small.nbytes == 1000
    pool.give(small)
    assert pool.held == 0


def test_the_pool_keeps_no_more_than_its_bound():
    pool = FramePool(max_bytes=4 * MiB)
    buffers = [pool.take(2 * MiB) for _ in range(3)]
    for buffer in buffers:
        pool.give(buffer)
    assert pool.held == 4 * MiB
