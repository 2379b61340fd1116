"""``MemoryTier``: what the memory tier keeps, where, and how often S3 gets a step too."""

from __future__ import annotations

import os
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

from s3ckpt.errors import ConfigError, MemoryTierError

DEFAULT_ROOT = Path("/dev/shm/s3ckpt")
ROOT_VARIABLE = "S3CKPT_MEMORY_ROOT"


def default_root() -> Path:
    """``$S3CKPT_MEMORY_ROOT``, else ``/dev/shm/s3ckpt``."""
    return Path(os.environ.get(ROOT_VARIABLE) or DEFAULT_ROOT)


@dataclass(frozen=True)
class MemoryTier:
    """Keep recent checkpoints in shared memory on each node, in front of S3.

    Args:
        keep: copies kept per rank (default 2). Each is a full copy of the rank's state, so
            the tier holds ``keep`` x the state in host memory; with ``keep=1`` the only
            copy is overwritten by each save, and a failure during that save leaves none.
        s3_every: a save of step ``N`` is also written to S3 when ``N % s3_every == 0``
            (default 1: every save). Choose a multiple of the save interval.
        root: a folder in a tmpfs shared by the ranks of one node (default
            ``$S3CKPT_MEMORY_ROOT``, else ``/dev/shm/s3ckpt``); copies live in
            ``<root>/run-<id>/rank-<r>/slot-<i>``.
        max_bytes: the most one rank's state may take. When given, the root's free room
            for ``keep`` copies of every local rank (``local_ranks``) is checked at
            construction, and a larger state fails its save before anything is written.
        local_ranks: ranks on this node that share ``root`` (default: ``LOCAL_WORLD_SIZE``,
            else 1), for that check.
        replicas: peers on other nodes each rank's copy is sent to after it is held
            (default 1; fewer when the job has fewer other nodes), outside the blocking
            path, so that a lost node's state is rebuilt from memory. Each rank keeps
            ``keep`` replicas of each peer it receives from. Needs ``keep >= 2``: the last
            replicated step must survive until the next one is replicated.
        node: the name of this rank's node for choosing peers (default: the host name;
            set it where the launcher's layout differs, or to simulate nodes).
    """

    keep: int = 2
    s3_every: int = 1
    root: Path = field(default_factory=default_root)
    max_bytes: int | None = None
    local_ranks: int | None = None
    replicas: int = 1
    node: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        for name in ("keep", "s3_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"MemoryTier {name} must be a positive int, got {value!r}")
        if (
            isinstance(self.replicas, bool)
            or not isinstance(self.replicas, int)
            or self.replicas < 0
        ):
            raise ConfigError(f"MemoryTier replicas must be an int >= 0, got {self.replicas!r}")
        if self.replicas and self.keep < 2:
            raise ConfigError(
                "MemoryTier keep=1 with replicas would overwrite the last replicated step "
                "before the next one is replicated: keep at least 2, or replicas=0"
            )
        if self.max_bytes is not None and (
            isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int)
            or self.max_bytes < 1
        ):  # fmt: skip
            raise ConfigError(
                f"MemoryTier max_bytes must be a positive int, got {self.max_bytes!r}"
            )

    def node_name(self) -> str:
        return self.node or socket.gethostname()

    def to_s3(self, step: int) -> bool:
        """Whether a save of ``step`` is also written to S3."""
        return step % self.s3_every == 0

    def check_room(self, run_folder: Path, copies_per_rank: int | None = None) -> None:
        """Make the root, and fail now if it cannot hold what :attr:`max_bytes` asks for:
        ``copies_per_rank`` (own copies and replicas; default ``keep``) for each local rank
        (the run's copies already in ``run_folder`` count as room: they are reused)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise MemoryTierError(f"cannot use {self.root} for the memory tier: {exc}") from exc
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise MemoryTierError(f"cannot use {self.root} for the memory tier: not writable")
        if self.max_bytes is None:
            return
        ranks = self.local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        copies = copies_per_rank or self.keep
        needed = self.max_bytes * copies * ranks
        free = shutil.disk_usage(self.root).free + _held_bytes(run_folder)
        if needed > free:
            raise MemoryTierError(
                f"the memory tier needs {needed} bytes at {self.root} ({copies} copies of "
                f"up to {self.max_bytes} bytes for {ranks} local rank(s)); it has {free} "
                "bytes free (counting the copies already there): lower keep or max_bytes, "
                "or give the tmpfs more room"
            )


def _held_bytes(run_folder: Path) -> int:
    """Bytes of the run's segment files already there (reused, so they count as free)."""
    return sum(path.stat().st_size for path in run_folder.rglob("segment-*"))
