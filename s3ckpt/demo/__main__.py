"""``make demo``: train, crash in the middle of a checkpoint upload, resume, and account.

1. Start a private S3 server (SeaweedFS on 127.0.0.1).
2. Train a small GPT (:mod:`s3ckpt.demo.train`, a child process) with an async checkpoint
   every ``--every`` steps; when it reports that the save of the chosen step has started
   uploading, SIGKILL it: no clean-up, no atexit, exactly a crashed node.
3. Show that the killed save is invisible (no manifest) and what it left behind.
4. Start training again: it resumes from the latest committed checkpoint and finishes.
5. Summarize the loss across the crash and the cost of checkpointing, then list, prune and
   garbage-collect with the ``s3ckpt`` command.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from s3ckpt import catalog
from s3ckpt.config import S3URI
from s3ckpt.demo import report
from s3ckpt.manager.policy import checkpoint_name, parse_step
from s3ckpt.testing.local_s3 import LocalS3Server
from s3ckpt.units import human_bytes

_STARTED = re.compile(r"^save (step-\d+) started")


@dataclass(frozen=True)
class Run:
    returncode: int
    killed_at: str | None  # checkpoint whose upload was running at the SIGKILL
    seconds: float


def say(text: str = "") -> None:
    print(text, flush=True)


def banner(text: str) -> None:
    say()
    say(f"== {text} " + "=" * max(0, 74 - len(text)))


def upload_seen(client: Any, uri: str, name: str, timeout: float = 10.0) -> str:
    """Wait until the save into ``name`` has bytes on the server; describe what is there.

    The trainer says "started" once the state is staged, but DCP still plans (a few
    requests) before the first byte goes out; killing only once an upload is open
    makes certain the crash lands in the middle of the transfer, not before it. The
    client is created (and connected) beforehand: that takes longer than an upload.
    """
    location = S3URI.parse(uri)
    prefix = location.key(name) + "/"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        uploads = client.list_multipart_uploads(Bucket=location.bucket, Prefix=prefix)
        objects = client.list_objects_v2(Bucket=location.bucket, Prefix=prefix + "data/")
        n_uploads, n_objects = len(uploads.get("Uploads", [])), objects.get("KeyCount", 0)
        if n_uploads or n_objects:
            return f"{n_uploads} multipart upload(s) open, {n_objects} object(s) written"
        time.sleep(0.01)
    return "no upload seen yet"


def train(
    args: argparse.Namespace,
    env: dict[str, str],
    log: Path,
    kill: str | None = None,
    client: Any = None,
) -> Run:
    """Run the trainer, echoing its lines; SIGKILL it once ``kill`` is uploading."""
    command = [
        sys.executable, "-m", "s3ckpt.demo.train", "--uri", args.uri,
        "--steps", str(args.steps), "--every", str(args.every),
        "--keep-last", str(args.keep_last), "--log", str(log),
        "--progress-every", str(args.progress_every),
    ]  # fmt: skip
    if args.keep_every:
        command += ["--keep-every", str(args.keep_every)]
    started = time.perf_counter()
    child = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    killed_at = None
    assert child.stdout is not None
    for line in child.stdout:
        say(f"  | {line.rstrip()}")
        match = _STARTED.match(line)
        if kill is not None and killed_at is None and match and match.group(1) == kill:
            seen = upload_seen(client, args.uri, kill) if client else "not checked"
            child.send_signal(signal.SIGKILL)
            killed_at = kill
            say(
                f"  >> SIGKILL to the trainer (pid {child.pid}) during the upload of {kill}: {seen}"
            )
    return Run(child.wait(), killed_at, time.perf_counter() - started)


def inspect_crash(args: argparse.Namespace, server: LocalS3Server, killed: str) -> int | None:
    """What the store shows after the crash; returns the step a restart will resume from."""
    infos = catalog.list_checkpoints(
        args.uri,
        include_uncommitted=True,
        endpoint_url=server.endpoint_url,
        access_key_id=server.access_key,
        secret_access_key=server.secret_key,
        region=server.region,
    )
    location = S3URI.parse(args.uri)
    uploads = server.client().list_multipart_uploads(
        Bucket=location.bucket, Prefix=location.key(killed) + "/"
    )
    open_uploads = len(uploads.get("Uploads", []))
    for info in infos:
        state = "committed" if info.committed else "NOT committed (no manifest)"
        say(f"  {info.name}  {state:27} {info.objects:2d} objects {human_bytes(info.bytes):>9}")
    victim = next((i for i in infos if i.name == killed), None)
    if victim is None or not victim.committed:
        left = f"{victim.objects} object(s)" if victim else "no objects"
        say(
            f"  {killed}: the killed save left {left} and {open_uploads} open multipart "
            "upload(s), but no manifest: readers and restarts do not see it"
        )
    else:
        say(f"  note: {killed} committed before the SIGKILL landed (a very fast store)")
    steps = [s for i in infos if i.committed and (s := parse_step(i.name)) is not None]
    return max(steps) if steps else None


def cli(env: dict[str, str], *argv: str) -> None:
    say(f"$ s3ckpt {' '.join(argv)}")
    done = subprocess.run(
        [sys.executable, "-m", "s3ckpt", *argv], env=env, capture_output=True, text=True
    )
    for line in (done.stdout + done.stderr).rstrip().splitlines():
        say(f"  {line}" if line else "")


def kill_step(steps: int, every: int) -> int:
    """The save to interrupt: about 60% of the way, with at least one commit before it."""
    saves = steps // every
    if saves < 2:
        raise SystemExit("the demo needs at least two checkpoints: --steps >= 2 * --every")
    return every * min(saves, max(2, (saves * 3) // 5))


def demo(args: argparse.Namespace, server: LocalS3Server, workdir: Path) -> int:
    args.uri = f"s3://{server.bucket}/demo-run"
    env = {**os.environ, **server.env(), "PYTHONUNBUFFERED": "1"}
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):  # only the local server's credentials
        env.pop(name, None)
    env["AWS_CONFIG_FILE"] = env["AWS_SHARED_CREDENTIALS_FILE"] = str(workdir / "none")
    killed = checkpoint_name(kill_step(args.steps, args.every))

    banner(f"run 1: train {args.steps} steps, checkpoint every {args.every}; crash during {killed}")
    client = server.client()
    client.list_multipart_uploads(Bucket=server.bucket)  # connected before it matters
    first = train(args, env, workdir / "run1.jsonl", kill=killed, client=client)
    if first.killed_at is None:
        say(f"  the trainer exited ({first.returncode}) before {killed} started: nothing to resume")
        return 1

    banner("after the crash: what is in the bucket")
    resume = inspect_crash(args, server, killed)
    if resume is None:
        say("  no committed checkpoint to resume from")
        return 1

    banner(f"run 2: restart; it resumes from step-{resume:010d} and finishes")
    second = train(args, env, workdir / "run2.jsonl")
    if second.returncode != 0:
        say(f"  the resumed run failed with exit status {second.returncode}")
        return 1

    banner("summary")
    run1, run2 = (report.read_events(workdir / f"run{i}.jsonl") for i in (1, 2))
    for line in report.summary_lines(run1, run2, resume, int(killed[5:]), args.steps):
        say(f"  {line}" if line else "")

    banner("the s3ckpt command: list, collect the crash's garbage, prune")
    cli(env, "ls", args.uri, "--all")
    # gc and prune leave a save alone while its in-flight record is fresh (5 min by
    # default); the killed trainer is known dead here, so the demo need not wait for that.
    say("  (the killed trainer is known dead: gc need not wait for its save's lease to expire)")
    cli(env, "gc", args.uri, "--older-than", "0s", "--force", "--in-flight-lease", "0s")
    cli(env, "prune", args.uri, "--keep-last", "2")
    cli(env, "ls", args.uri, "--all")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m s3ckpt.demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps in total")
    parser.add_argument("--every", type=int, default=25, help="checkpoint every N steps")
    parser.add_argument("--keep-last", type=int, default=3, help="retention: keep the last N")
    parser.add_argument("--keep-every", type=int, default=100, help="retention: keep multiples")
    parser.add_argument("--quick", action="store_true", help="40 steps, every 10 (for tests)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.every, args.keep_every = 40, 10, None
    args.progress_every = 10 if args.steps <= 100 else 25
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    say("s3ckpt demo: a training run that crashes in the middle of a checkpoint and resumes")
    say("starting a private S3 server (SeaweedFS) on 127.0.0.1 ...")
    with LocalS3Server() as server, tempfile.TemporaryDirectory(prefix="s3ckpt-demo-") as tmp:
        say(f"  endpoint {server.endpoint_url}, bucket s3://{server.bucket}")
        status = demo(args, server, Path(tmp))
    say()
    say(f"demo {'finished' if status == 0 else 'FAILED'} in {time.perf_counter() - started:.0f} s")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
