"""The demo's training process: a small GPT on the generated corpus, checkpointed by
:class:`s3ckpt.CheckpointManager` every ``--every`` steps, resuming from the latest commit.

Run by ``python -m s3ckpt.demo`` (which kills it mid-save and starts it again), or by
hand against any S3 endpoint configured through the ``AWS_*`` environment variables::

    python -m s3ckpt.demo.train --uri s3://bucket/demo-run --steps 300 --every 25

Step ``N`` means "N optimizer updates done"; checkpoint ``step-N`` holds the state right
after update ``N``, so a restart resumes at ``N + 1``. The batch of each step depends on
the step alone, so a resumed run trains on exactly what an uninterrupted one would.
Every step and every commit is appended as one JSON line to ``--log`` for the summary.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from s3ckpt import CheckpointManager, SaveMetrics
from s3ckpt.demo.corpus import Corpus, generate
from s3ckpt.demo.model import ModelConfig, TinyGPT
from s3ckpt.units import human_bytes

BATCH, SEQ_LEN, WARMUP = 16, 64, 20


class TrainState(Stateful):
    """Model, optimizer and schedule as one Stateful, the pattern of the DCP tutorial:
    ``get_state_dict``/``set_state_dict`` give DCP plain FQN-keyed state on one rank or
    many (FSDP, DDP), and DCP calls these methods itself when saving and loading."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule: Any):
        self.model, self.optimizer, self.schedule = model, optimizer, schedule

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optimizer, "schedule": self.schedule.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
        self.schedule.load_state_dict(state_dict["schedule"])


class EventLog:
    """JSON lines for the parent and plain lines for the terminal, from any thread."""

    def __init__(self, path: Path | None) -> None:
        self._file = path.open("a") if path else None
        self._lock = threading.Lock()

    def record(self, **fields: Any) -> None:
        if self._file is not None:
            with self._lock:
                self._file.write(json.dumps(fields) + "\n")
                self._file.flush()

    @staticmethod
    def say(text: str) -> None:
        sys.stdout.write(f"{text}\n")  # one write: lines from other threads never interleave
        sys.stdout.flush()


def build(total_steps: int, seed: int) -> tuple[Corpus, TinyGPT, TrainState]:
    corpus = Corpus(generate())
    torch.manual_seed(seed)
    model = TinyGPT(ModelConfig(corpus.vocab_size, seq_len=SEQ_LEN, d_model=256, n_layers=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine down to 10%
        if step < WARMUP:
            return (step + 1) / WARMUP
        progress = min(1.0, (step - WARMUP) / max(1, total_steps - WARMUP))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    return corpus, model, TrainState(model, optimizer, schedule)


def train_step(corpus: Corpus, model: TinyGPT, state: TrainState, step: int) -> float:
    ids, targets = corpus.batch(step, BATCH, SEQ_LEN)
    loss = model.loss(ids, targets)
    state.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    state.optimizer.step()
    state.schedule.step()
    return float(loss.detach())


def run(args: argparse.Namespace) -> int:
    events = EventLog(args.log)
    corpus, model, train_state = build(args.steps, args.seed)
    state = {"app": train_state}
    size = sum(p.numel() for p in model.parameters())
    events.say(f"model: {size / 1e6:.1f} M parameters, {human_bytes(size * 12)} of state")

    def on_saved(metrics: SaveMetrics) -> None:
        events.record(kind="save", **metrics.as_dict())

    manager = CheckpointManager(
        args.uri, keep_last=args.keep_last, keep_every=args.keep_every, on_saved=on_saved
    )
    with manager:
        started = time.perf_counter()
        restored = manager.load_latest(state)
        if restored is None:
            events.say("no checkpoint yet: training from scratch")
        else:
            seconds = time.perf_counter() - started
            events.say(f"resumed from step-{restored:010d} (loaded in {seconds:.2f} s)")
            events.record(kind="resume", step=restored, load_s=seconds)
        loop(args, corpus, model, train_state, manager, events, first=(restored or 0) + 1)
        manager.wait()
        events.say(f"done; committed steps now: {manager.steps()}")
    return 0


def loop(
    args: argparse.Namespace,
    corpus: Corpus,
    model: TinyGPT,
    train_state: TrainState,
    manager: CheckpointManager,
    events: EventLog,
    first: int,
) -> None:
    state = {"app": train_state}
    recent: list[float] = []
    for step in range(first, args.steps + 1):
        busy_before = manager.busy
        t0 = time.perf_counter()
        loss = train_step(corpus, model, train_state, step)
        saved, blocked = False, 0.0
        if step % args.every == 0:
            t_save = time.perf_counter()
            saved = manager.save(step, state)  # returns once staged
            blocked = time.perf_counter() - t_save
        dt = time.perf_counter() - t0
        active = busy_before or saved or manager.busy
        events.record(kind="step", step=step, loss=loss, dt=dt, ckpt=active)
        recent.append(dt)
        if saved:  # the parent may SIGKILL us on this line, while the upload runs
            events.say(f"save step-{step:010d} started (loop blocked {blocked:.3f} s); uploading")
        if step % args.progress_every == 0 or step == args.steps:
            mean_ms = 1000 * sum(recent) / len(recent)
            events.say(f"step {step:4d}/{args.steps}  loss {loss:.4f}  {mean_ms:4.0f} ms/step")
            recent.clear()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m s3ckpt.demo.train", description=__doc__)
    parser.add_argument("--uri", required=True, help="s3://bucket/run prefix for checkpoints")
    parser.add_argument("--steps", type=int, default=300, help="total optimizer steps")
    parser.add_argument("--every", type=int, default=25, help="checkpoint every N steps")
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--keep-every", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress-every", type=int, default=10)
    parser.add_argument("--log", type=Path, default=None, help="append JSON lines here")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 leaves a core for the upload)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(stream=sys.stdout, format="s3ckpt.manager: %(message)s")
    logging.getLogger("s3ckpt.manager").setLevel(logging.INFO)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
