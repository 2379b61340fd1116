"""How long each thread of a thread-mode save holds the GIL: ``python -m benchmarks.gil_held``.

The ``loop`` benchmark's slowdowns swing by 20 points and more from rep to rep, so a change
that takes a few milliseconds of Python out of a save does not show there. What a
thread-mode save costs a training loop beside it is, to first order, the time the save's
threads hold the GIL, and that can be measured directly: uprobes on CPython's
``take_gil`` (its return) and ``drop_gil`` (``perf probe`` on the interpreter's
libpython), recorded by ``perf`` while saves of the loop benchmark's 1 GiB state run on
the zero-cost server with no loop beside them. Each hold is a ``take_gil`` return up to
the thread's next ``drop_gil``; the part of it inside a save (from the save call to its
upload's end) is summed per thread, then averaged over the saves. A run whose probe hits
do not pair up (perf lost events) fails rather than under-counts.

Threads: ``caller`` (the thread that called save: the staging copy, and DCP's own work
before it hands over), ``save thread`` (the thread that runs the storage's
``write_data``: DCP's executor in ``dcp.async_save``, the manager's saver), ``s3ckpt-io``
(the I/O loop), ``s3ckpt-wire`` (the native batches' threads), and any other. A probe hit
costs about a microsecond, which the holds include: compare modes within one run.

Holds are counted too (``takes``: a ``take_gil`` return inside a save, per thread but
the caller): each one is a hand-over, and beside a loop that wants the GIL every
hand-over costs the loop a wait for the switch as well as the hold itself (20-35 us per
retake, :mod:`s3ckpt.format.checksums`), so fewer, longer holds cost it less than many
short ones of the same total.

Needs root, ``perf`` and a libpython with its symbols (probes this run adds are removed
at its end); each mode runs in its own process (:func:`case`).

    python -m benchmarks.gil_held [--modes dcp_thread,manager_thread,floor_no_network,
                                   floor_native_batch] [--saves 6] [--state nested|flat]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.loop_cases import MODES, STATE_SHAPES, shaped
from benchmarks.zero_cost import _delete_prefix
from benchmarks.zero_server import ZeroS3

GROUP = "s3ckpt_gil"
EVENTS = (f"{GROUP}:take_gil__return", f"{GROUP}:drop_gil")
DEFAULT_MODES = "dcp_thread,manager_thread,floor_no_network,floor_native_batch"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", default=DEFAULT_MODES)
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--state", choices=STATE_SHAPES, default=STATE_SHAPES[0])
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        parser.error("unknown mode")
    before = _probes()
    try:
        _add_probes(_libpython(), before)
        rows = _measure(modes, args.saves, args.state)
    finally:
        for event in sorted(_probes() - before):
            subprocess.run(["perf", "probe", "-q", "-d", event], check=False)
    print(table(rows, args.saves, args.state))
    return 0


def _libpython() -> str:
    """The file holding the interpreter's ``take_gil``: libpython, or the executable."""
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        name = sysconfig.get_config_var("INSTSONAME") or sysconfig.get_config_var("LDLIBRARY")
        return str(Path(sysconfig.get_config_var("LIBDIR")) / name)
    return os.path.realpath(sys.executable)


def _add_probes(binary: str, present: set[str]) -> None:
    """The two uprobes, under :data:`GROUP`, where not ``present`` already."""
    for event, spec in zip(EVENTS, ("take_gil%return", "drop_gil"), strict=True):
        if event not in present:  # perf names a return probe NAME__return itself
            name = event.split(":")[1].removesuffix("__return")
            done = subprocess.run(
                ["perf", "probe", "-q", "-x", binary, "-a", f"{GROUP}:{name}={spec}"],
                capture_output=True, text=True,
            )  # fmt: skip
            if done.returncode != 0 or event not in _probes():
                raise RuntimeError(f"perf probe could not add {event}: {done.stderr.strip()}")


def _probes() -> set[str]:
    """The uprobe events defined now (``perf probe -l``)."""
    listed = subprocess.run(["perf", "probe", "-l"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def _measure(modes: list[str], saves: int, state: str) -> list[dict[str, Any]]:
    rows = []
    # The pool touched in advance matters for upload times, not for the holds measured.
    with ZeroS3(pool_mib=4096) as server:
        for mode in modes:
            print(f"measuring {mode} ...", file=sys.stderr, flush=True)
            prefix = f"gil-{int(time.time() * 1000)}"
            env = {**os.environ, **server.env(), "BENCH_BUCKET": server.bucket,
                   "BENCH_PREFIX": prefix, "BENCH_STATE": state}  # fmt: skip
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.gil_held", "--case", mode, str(saves)],
                env=env, capture_output=True, text=True, timeout=1200,
            )  # fmt: skip
            if done.returncode != 0 or not done.stdout.strip():
                raise RuntimeError(f"{mode} failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            _delete_prefix(server, prefix)
    return rows


def case(mode: str, saves: int) -> dict[str, Any]:
    """In this process: two saves to warm up, then ``saves`` under ``perf record``."""
    import torch

    from benchmarks.data import make_state
    from benchmarks.loop_floors import ViewingWriter
    from s3ckpt.dcp.writer import S3StorageWriter

    torch.set_num_threads(1)
    save_threads: set[int] = set()
    for cls in (S3StorageWriter, ViewingWriter):
        _note_thread(cls, save_threads)
    state = shaped(make_state(1024))
    save = MODES[mode]()
    for i in range(2):
        save(state, i).result()
    record = Path(os.environ.get("TMPDIR", "/tmp")) / f"s3ckpt-gil-{os.getpid()}.data"
    windows = _recorded_saves(save, state, saves, record)
    names = {t.native_id: t.name for t in threading.enumerate()}
    names[threading.main_thread().native_id] = "caller"
    names.update(dict.fromkeys(save_threads, "save thread"))
    try:
        events = _events(record)
        held = _holds(events, windows, names)
    finally:
        record.unlink(missing_ok=True)
    per_save = {who: seconds / saves * 1e3 for who, seconds in held.most_common()}
    takes = _takes(events, windows, names)
    return {
        "mode": mode,
        "held_ms_per_save": per_save,
        "background_ms_per_save": sum(v for k, v in per_save.items() if k != "caller"),
        "background_takes_per_save": sum(n for k, n in takes.items() if k != "caller") / saves,
        "takes_per_save": {k: n / saves for k, n in takes.items()},
        "save_s": sum(end - start for start, end in windows) / saves,
    }


def _recorded_saves(save: Any, state: Any, saves: int, record: Path) -> list[tuple[float, float]]:
    """Run ``saves`` saves one after the other under ``perf record`` (into ``record``);
    each one's window on the monotonic clock perf stamps its hits with."""
    events = [arg for event in EVENTS for arg in ("-e", event)]
    perf = subprocess.Popen(
        ["perf", "record", "-q", "-k", "mono", *events, "-p", str(os.getpid()), "-o", str(record)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(1.5)  # perf attached
    windows = []
    try:
        for i in range(2, 2 + saves):
            started = time.clock_gettime(time.CLOCK_MONOTONIC)
            save(state, i).result()
            windows.append((started, time.clock_gettime(time.CLOCK_MONOTONIC)))
            time.sleep(0.3)
    finally:
        perf.send_signal(2)
        perf.wait()
    return windows


def _note_thread(cls: type, threads: set[int]) -> None:
    """Record which thread runs ``cls.write_data``."""
    original = cls.write_data

    def write_data(self: Any, *args: Any, **kwargs: Any) -> Any:
        threads.add(threading.get_native_id())
        return original(self, *args, **kwargs)

    cls.write_data = write_data  # type: ignore[method-assign]


def _events(record: Path) -> list[tuple[int, float, bool]]:
    """``(thread id, time, taken)`` per probe hit; ``taken`` False for a ``drop_gil``."""
    out = subprocess.run(
        ["perf", "script", "-i", str(record), "-F", "tid,time,event"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    events = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 3:
            events.append((int(fields[0]), float(fields[1].rstrip(":")), "take_gil" in fields[2]))
    return events


def _holds(
    events: list[tuple[int, float, bool]],
    windows: list[tuple[float, float]],
    names: dict[int, str],
) -> collections.Counter[str]:
    """Seconds of GIL held per thread name inside the windows (each hold clipped to them).

    Raises where the hits do not pair up: a thread taking the GIL twice without a drop
    between, or dropping it without a take, beyond the one hold perf may have caught
    half of at its start or end."""
    held: collections.Counter[str] = collections.Counter()
    taken: dict[int, float] = {}
    unpaired = 0
    for tid, at, is_take in events:
        if is_take:
            unpaired += tid in taken
            taken[tid] = at
            continue
        start = taken.pop(tid, None)
        if start is None:
            unpaired += 1
            continue
        inside = sum(max(0.0, min(at, b) - max(start, a)) for a, b in windows)
        if inside:
            held[_group(names.get(tid, "other"))] += inside
    if not events or unpaired > 2 * len({tid for tid, _, _ in events}):
        raise RuntimeError(f"{len(events)} probe hits, {unpaired} unpaired: perf lost events")
    return held


def _takes(
    events: list[tuple[int, float, bool]],
    windows: list[tuple[float, float]],
    names: dict[int, str],
) -> collections.Counter[str]:
    """GIL takes inside the windows, per thread name: the hand-overs."""
    takes: collections.Counter[str] = collections.Counter()
    for tid, at, is_take in events:
        if is_take and any(a <= at <= b for a, b in windows):
            takes[_group(names.get(tid, "other"))] += 1
    return takes


def _group(name: str) -> str:
    """The native batches' threads count as one."""
    return "s3ckpt-wire" if name.startswith("s3ckpt-wire") else name


_WHO = ("caller", "save thread", "s3ckpt-io", "s3ckpt-wire", "other")


def table(rows: list[dict[str, Any]], saves: int, state: str) -> str:
    head = (
        f"{'mode':<20} "
        + " ".join(f"{w:>12}" for w in _WHO)
        + f" {'background':>11} {'bg takes':>9} {'save s':>7}"
    )
    lines = [f"GIL held per save, ms ({saves} saves of 1 GiB, state {state}; no loop beside)",
             head, "-" * len(head)]  # fmt: skip
    for row in rows:
        cells = _cells(row["held_ms_per_save"])
        lines.append(f"{row['mode']:<20} " + " ".join(f"{c:12.1f}" for c in cells)
                     + f" {row['background_ms_per_save']:11.1f}"
                     + f" {row.get('background_takes_per_save', 0.0):9.0f} {row['save_s']:7.2f}")  # fmt: skip
    lines += ["", "GIL takes per save (hand-overs), by thread", head.split(" background")[0]]
    for row in rows:
        cells = _cells(row.get("takes_per_save", {}))
        lines.append(f"{row['mode']:<20} " + " ".join(f"{c:12.0f}" for c in cells))
    return "\n".join(lines)


def _cells(by_thread: dict[str, float]) -> list[float]:
    """The named threads' values, then the sum of every other thread's as "other"."""
    named = _WHO[:-1]
    return [by_thread.get(w, 0.0) for w in named] + [
        sum(v for k, v in by_thread.items() if k not in named)
    ]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--case"]:
        print(json.dumps(case(sys.argv[2], int(sys.argv[3]))), flush=True)
        os._exit(0)  # DCP's and the manager's background threads are not waited for
    sys.exit(main())
