"""The tracer behind :mod:`benchmarks.walks`, installed in every process of a traced run.

A ``sitecustomize`` that :mod:`benchmarks.walks` writes calls :func:`install` when
``S3CKPT_WALK_DIR`` is set: from then on every Python function call of the process, in
every thread, is looked at, and while the one-byte window file ``S3CKPT_WALK_WINDOW``
(a memory map shared by all the run's processes) holds a window's number, each call into
s3ckpt's own code is recorded as ``(caller module, callee module)``, the caller being the
nearest s3ckpt frame below it through pass-through library frames (None where the call was
scheduled: the event loop resuming a task, a thread starting, an executor running a job).
Each send on a socket (and each call into the native sender) made in a window records the
s3ckpt modules on the stack at that moment, and the same stack continued through the
scheduling hops that led to it (its *path*): a task continues the stack that created it
(through a task factory set on every event loop made, and
``asyncio.run_coroutine_threadsafe``), a thread the stack that started
it, an executor's job the stack that submitted it. At exit the process writes what it saw
to ``<S3CKPT_WALK_DIR>/<pid>.json``: the calls, and each send's stack with its path.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import mmap
import os
import socket
import sys
import threading
import weakref
from pathlib import Path
from types import FrameType
from typing import Any

WINDOWS = {1: "save", 2: "load"}
# Library frames a direct call passes through (wrappers); any other library frame below a
# call (asyncio, threading, concurrent.futures, selectors) means it was scheduled.
PASS_THROUGH = ("functools", "contextlib", "abc", "typing", "dataclasses", "weakref")
SENDS = {"send", "sendall", "sendmsg", "sendto", "write", "writelines"}


def install() -> None:
    out = Path(os.environ["S3CKPT_WALK_DIR"])
    with open(os.environ["S3CKPT_WALK_WINDOW"], "r+b") as file:
        window = mmap.mmap(file.fileno(), 1)
    seen: dict[str, set[tuple[str | None, str]]] = {name: set() for name in WINDOWS.values()}
    # Per window, each send's (stack, path).
    sends: dict[str, set[tuple[tuple[str, ...], tuple[str, ...]]]] = {
        name: set() for name in [*WINDOWS.values(), "other"]
    }
    names: dict[str, str | None] = {}
    origins: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()
    submitted: dict[int, tuple[str, ...]] = {}  # id(coroutine) -> the stack that handed it over
    running = threading.local()  # .origin: the stack that submitted the executor job running

    def module_of(filename: str) -> str | None:
        name = names.get(filename, "")
        if name != "":
            return name
        marker = f"{os.sep}s3ckpt{os.sep}"
        at = filename.rfind(marker)
        name = None
        if at >= 0 and filename.endswith(".py"):
            name = "s3ckpt/" + filename[at + len(marker) :]
        names[filename] = name
        return name

    def caller_of(frame: FrameType) -> str | None:
        below = frame.f_back
        while below is not None:
            filename = below.f_code.co_filename
            module = module_of(filename)
            if module is not None:
                return module
            if not Path(filename).stem.startswith(PASS_THROUGH):
                return None
            below = below.f_back
        return None

    def stack_of(frame: FrameType | None) -> tuple[str, ...]:
        modules: list[str] = []
        while frame is not None:
            module = module_of(frame.f_code.co_filename)
            if module is not None and module not in modules:
                modules.append(module)
            frame = frame.f_back
        return tuple(reversed(modules))

    def origin() -> tuple[str, ...]:
        """The path that led to the running task, executor job or thread."""
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        if task is not None and task in origins:
            return origins[task]
        job = getattr(running, "origin", None)
        if job is not None:
            return job
        return origins.get(threading.current_thread(), ())

    def path_of(frame: FrameType | None) -> tuple[str, ...]:
        before = origin()
        return before + tuple(m for m in stack_of(frame) if m not in before)

    real_threadsafe = asyncio.run_coroutine_threadsafe
    real_start = threading.Thread.start
    real_submit = concurrent.futures.ThreadPoolExecutor.submit

    def task_factory(loop: Any, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        before = submitted.pop(id(coro), None)
        task = asyncio.Task(coro, loop=loop, **kwargs)
        origins[task] = before if before is not None else path_of(sys._getframe(1))
        return task

    def tracing(new_event_loop: Any) -> Any:
        def made() -> Any:
            loop = new_event_loop()
            loop.set_task_factory(task_factory)
            return loop

        return made

    def run_coroutine_threadsafe(coro: Any, loop: Any) -> Any:
        submitted[id(coro)] = path_of(sys._getframe(1))
        return real_threadsafe(coro, loop)

    def start(self: threading.Thread) -> None:
        origins[self] = path_of(sys._getframe(1))
        real_start(self)

    def submit(self: Any, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        before = path_of(sys._getframe(1))

        def job() -> Any:
            outer = getattr(running, "origin", None)
            running.origin = before
            try:
                return fn(*args, **kwargs)
            finally:
                running.origin = outer

        return real_submit(self, job)

    asyncio.new_event_loop = asyncio.events.new_event_loop = tracing(asyncio.new_event_loop)
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        pass
    else:
        uvloop.new_event_loop = tracing(uvloop.new_event_loop)
    asyncio.run_coroutine_threadsafe = run_coroutine_threadsafe
    asyncio.tasks.run_coroutine_threadsafe = run_coroutine_threadsafe
    threading.Thread.start = start  # type: ignore[method-assign]
    concurrent.futures.ThreadPoolExecutor.submit = submit  # type: ignore[method-assign]

    def is_send(function: Any) -> bool:
        owner = getattr(function, "__self__", None)
        if getattr(function, "__module__", None) == "s3ckpt.s3.wire._sender":
            return True
        return function.__name__ in SENDS and isinstance(owner, socket.socket)

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        which = window[0]
        if not which:
            return
        name = WINDOWS.get(which, "other")
        if event == "c_call":
            if is_send(arg):
                sends[name].add((stack_of(frame), path_of(frame)))
            return
        if event != "call":
            return
        callee = module_of(frame.f_code.co_filename)
        if callee is None:
            return
        seen[name].add((caller_of(frame), callee))

    def dump() -> None:
        sys.setprofile(None)
        record: dict[str, Any] = {
            name: sorted([a or "", b] for a, b in edges) for name, edges in seen.items()
        }
        record["sends"] = {
            name: sorted([list(stack), list(path)] for stack, path in found)
            for name, found in sends.items()
        }
        (out / f"{os.getpid()}.json").write_text(json.dumps({"argv": sys.argv, **record}))

    seen["other"] = set()
    real_exit = os._exit

    def exiting(code: int) -> None:
        dump()
        real_exit(code)

    os._exit = exiting  # the checkpoint process may leave through os._exit
    atexit.register(dump)
    threading.setprofile(profile)
    sys.setprofile(profile)
