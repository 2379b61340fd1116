"""When a checkpoint process saving at a lowered priority must get the trainer's back.

A checkpoint process saves at the trainer's nice value + N so that, where the training
loop and the upload want the same core, the loop gets it. That only pays while the node
has a core the loop leaves idle: once other normal-priority work (data-loader workers,
another job) keeps every core busy, a niced process gets a tenth of a core's share and the
save, which is the newest durable checkpoint, falls ever further behind
(docs/decisions/0001-checkpoint-process-priority.md). :class:`Contention` watches the
demand for the node's cores while a save is in flight (the runnable tasks the kernel
counts in ``/proc/loadavg``, less the checkpoint process's own) and says when the other
tasks fill every core; the trainer's side then runs the process at the trainer's priority
until they leave one idle again. Demand, not CPU time, is sampled: a runnable task counts
whether or not it got the core, so what the process's priority does to the others does
not feed back into the decision.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("s3ckpt.background")

SAMPLE_EVERY_S = 0.25  # a read of /proc/loadavg and of the process's task states each time
WINDOW = 4  # samples averaged: one second of demand
IDLE_CORE = 0.5  # fewer runnable others than cores - this: a core is (mostly) idle


def runnable_tasks() -> int:
    """The node's runnable tasks now (``/proc/loadavg``'s fourth field), the caller's
    own included."""
    with open("/proc/loadavg", "rb") as loadavg:
        return int(loadavg.read().split()[3].split(b"/")[0])


def runnable_threads(pid: int) -> int:
    """How many threads of process ``pid`` are runnable now (state ``R``); 0 once it is
    gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    running = 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat", "rb") as stat:
                fields = stat.read()
        except OSError:  # a thread that ended meanwhile
            continue
        running += fields[fields.rindex(b")") + 2 : fields.rindex(b")") + 3] == b"R"
    return running


def others_fill_the_cores(samples: collections.deque[int], cores: int) -> bool:
    """Whether the runnable tasks other than the checkpoint process's, averaged over
    ``samples``, leave no core idle."""
    return bool(samples) and sum(samples) / len(samples) >= cores - IDLE_CORE


class Contention:
    """A thread that, while :meth:`watch` says a save is in flight, samples the demand
    for the cores beside process ``pid`` and calls ``changed(True)`` when the other tasks
    fill every core, ``changed(False)`` when they leave one idle again (and at the end of
    each watch, if it had said True)."""

    def __init__(self, pid: int, changed: Callable[[bool], None], cores: int | None = None):
        self._pid = pid
        self._changed = changed
        self._cores = cores or os.cpu_count() or 1
        self._watching = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(
            target=self._run, name=f"s3ckpt-contention-{pid}", daemon=True
        )
        self._thread.start()

    def watch(self, active: bool) -> None:
        """Sample while ``active`` (a save is in flight); idle otherwise."""
        if active:
            self._watching.set()
        else:
            self._watching.clear()

    def stop(self) -> None:
        self._stopped = True
        self._watching.set()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        samples: collections.deque[int] = collections.deque(maxlen=WINDOW)
        contended = False
        try:
            while True:
                self._watching.wait()
                if self._stopped:
                    break
                # the sampler itself is one runnable task while it reads
                others = runnable_tasks() - 1 - runnable_threads(self._pid)
                samples.append(max(0, others))
                now = others_fill_the_cores(samples, self._cores)
                if now != contended:
                    contended = now
                    self._changed(contended)
                time.sleep(SAMPLE_EVERY_S)
                if not self._watching.is_set():
                    samples.clear()
                    if contended:
                        contended = False
                        self._changed(False)
        except Exception:  # a /proc without loadavg: the priority stays as configured
            log.debug("sampling the demand for cores failed", exc_info=True)
        if contended:
            self._changed(False)


def set_nice(pid: int, nice: int) -> None:
    """Set every thread of process ``pid`` to ``nice`` (Linux keeps one value per thread;
    threads started later inherit their starter's); a value this process may not set (a
    raise of priority, unprivileged) is left as is."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:  # it is gone: its end is reported elsewhere
        return
    for task in tasks:
        try:
            os.setpriority(os.PRIO_PROCESS, int(task), nice)
        except PermissionError:
            return
        except OSError:  # a thread that ended meanwhile
            continue


class SavePriority:
    """The priority of checkpoint process ``pid``, which saves at niceness ``nice`` (None:
    at the trainer's, and nothing here changes it): the trainer's own while a save is
    waited for (:meth:`hurry`) or while other work fills the cores (:class:`Contention`,
    sampling while :meth:`watch` says saves are in flight), ``nice`` otherwise."""

    def __init__(self, pid: int, nice: int | None) -> None:
        self._pid, self._nice = pid, nice
        self._trainer_nice = os.getpriority(os.PRIO_PROCESS, 0)
        self._hurried = self._contended = self._raised = False
        self._lock = threading.Lock()
        self._contention: Contention | None = None
        self._stopped = False

    def hurry(self, hurried: bool = True) -> None:
        """Someone waits for a save (``hurried``), or no longer does."""
        self._hurried = hurried
        self._apply()

    def contended(self, contended: bool) -> None:
        """Other work fills every core (``contended``), or leaves one idle again."""
        self._contended = contended
        self._apply()

    def watch(self, active: bool) -> None:
        """Saves are in flight (``active``): sample the demand for cores; none: stop, and
        drop a contention that no longer matters (an idle process's priority is moot)."""
        if self._nice is None or self._stopped:
            return
        if active and self._contention is None:
            self._contention = Contention(self._pid, self.contended)
        if self._contention is not None:
            self._contention.watch(active)
            if not active and self._contended:
                self.contended(False)

    def stop(self) -> None:
        """The process is gone: no more sampling, no more changes."""
        self._stopped = True
        if self._contention is not None:
            self._contention.stop()

    def _apply(self) -> None:
        if self._nice is None:
            return
        with self._lock:
            raise_it = self._hurried or self._contended
            if raise_it != self._raised and not self._stopped:
                self._raised = raise_it
                set_nice(self._pid, self._trainer_nice if raise_it else self._nice)
