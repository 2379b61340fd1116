"""The uploader reads the results of its own spawned work on the I/O loop: a future already
done is read at once, without the thread-safe hand-off that wakes the loop through its
self-pipe; one still pending, or cancelled, is awaited as ``asyncio.wrap_future`` does."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import pytest

from s3ckpt.transfer.thread_mode import result_of


def _counting_wakeups(loop: asyncio.AbstractEventLoop) -> list[object]:
    calls: list[object] = []
    original = loop.call_soon_threadsafe

    def counted(callback, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(callback)
        return original(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    return calls


def test_a_done_future_is_read_without_waking_the_loop():
    async def main() -> tuple[str, list[object]]:
        wakeups = _counting_wakeups(asyncio.get_running_loop())
        done: Future[str] = Future()
        done.set_result("upload-id")
        return await result_of(done), wakeups

    result, wakeups = asyncio.run(main())
    assert result == "upload-id" and wakeups == []


def test_a_failed_future_raises_its_error():
    async def main() -> None:
        failed: Future[str] = Future()
        failed.set_exception(KeyError("create failed"))
        await result_of(failed)

    with pytest.raises(KeyError, match="create failed"):
        asyncio.run(main())


def test_a_pending_future_is_awaited_until_another_thread_settles_it():
    async def main() -> str:
        pending: Future[str] = Future()
        threading.Timer(0.05, pending.set_result, args=("later",)).start()
        return await result_of(pending)

    assert asyncio.run(main()) == "later"


def test_a_cancelled_future_cancels_the_waiter():
    async def main() -> None:
        cancelled: Future[str] = Future()
        cancelled.cancel()
        await result_of(cancelled)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())


def test_the_caller_names_each_data_object_the_uploader_asks_for():
    """The uploader refuses an item that starts a new data object (none open, or the open
    one would outgrow max_object_size; an empty one takes any item) rather than overfill
    one; the caller names the object, and the item goes there."""
    from s3ckpt.config import S3Config
    from s3ckpt.transfer.upload import Placement, RankUploader

    class Unused:  # the requests of these small items are queued only once finished
        bucket = "bucket"
        config = S3Config()

    uploader = RankUploader(Unused(), max_object_size=10, size_hint=30)  # type: ignore[arg-type]
    assert uploader.add(memoryview(b"")) is None
    uploader.open("run/data-0", 0)
    assert uploader.add(memoryview(b"")) == Placement(0, 0, 0)
    assert uploader.add(memoryview(b"123456")) == Placement(0, 0, 6)
    assert uploader.add(memoryview(b"12345")) is None
    assert uploader.add(memoryview(b"1234")) == Placement(0, 6, 4)
    assert uploader.add(memoryview(b"1")) is None
    uploader.open("run/data-1", 25)
    assert uploader.add(memoryview(bytes(25))) == Placement(1, 0, 25)  # alone, however large
