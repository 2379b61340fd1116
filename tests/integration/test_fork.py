"""Writers, readers and the I/O loop survive pickling and fork."""

from __future__ import annotations

import multiprocessing
import pickle

import torch
import torch.distributed.checkpoint as dcp

from s3ckpt.s3.loop import io_loop


def _save_in_child(writer_bytes: bytes, queue) -> None:
    try:
        writer = pickle.loads(writer_bytes)
        dcp.save({"a": torch.arange(1000.0)}, storage_writer=writer)
        queue.put("ok")
    except BaseException as exc:  # report everything to the parent
        queue.put(repr(exc))


def test_a_forked_child_saves_with_a_pickled_writer(s3_prefix, make_writer, make_reader):
    # The parent has a running loop and a client before the fork.
    dcp.save({"warm": torch.ones(1)}, storage_writer=make_writer(s3_prefix + "-parent"))
    parent_loop = io_loop()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(
        target=_save_in_child, args=(pickle.dumps(make_writer(s3_prefix)), queue)
    )
    child.start()
    try:
        assert queue.get(timeout=60) == "ok"
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert io_loop() is parent_loop  # the parent's loop is untouched
    restored = {"a": torch.zeros(1000)}
    dcp.load(restored, storage_reader=pickle.loads(pickle.dumps(make_reader(s3_prefix))))
    assert torch.equal(restored["a"], torch.arange(1000.0))
