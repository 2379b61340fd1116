"""A simulated cluster on one machine: nodes and a storage server in network namespaces,
joined by shaped links that tests can cut, flap, partition and throttle.

::

    with Cluster(nodes=2, node_rate=25e6, storage_rate=50e6) as cluster:
        ranks = cluster.start_ranks([sys.executable, "train.py"], per_node=1)
        cluster.node(1).cut()                       # node 1's cable pulled
        ...
        codes = cluster.wait(ranks, timeout=60)

* each node is a namespace ``s3ckpt-<pid>-node<i>`` with a link of ``node_rate`` bytes/s
  each way, a folder of /dev/shm of its own (the memory tier's root there) and a name
  (``node<i>``, for ``MemoryTier(node=...)``);
* storage is a namespace with its own link (``storage_rate``) and a SeaweedFS S3 server
  (``weed mini``, as :class:`~s3ckpt.testing.local_s3.LocalS3Server` runs it) listening on
  the storage address: :attr:`Cluster.endpoint_url`;
* the host (this process) reaches every namespace through an unshaped link, so a test
  checks S3 (:meth:`Cluster.client`) without going through the shaped links;
* ranks are processes started in their node's namespace (``ip netns exec``) with the
  environment ``torch.distributed`` and s3ckpt read: ``MASTER_ADDR`` (the first node's
  address), ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``S3CKPT_MEMORY_ROOT``, ``S3CKPT_NODE``, ``GLOO_SOCKET_IFNAME``
  (the node's link) and the ``AWS_*``
  variables of the server: gloo and the memory tier's replication go node to node over
  the links, uploads over the node's link and the storage link.

Everything it made (namespaces, links, processes in them, the server, its folders) is
removed by :meth:`Cluster.stop`, which the context manager and :mod:`atexit` call; what a
killed process left is removed by the next cluster made on the machine
(:func:`~s3ckpt.testing.netns.sweep_stale`). Where namespaces cannot be made, starting
raises :class:`~s3ckpt.testing.netns.NetnsUnavailableError` (tests skip with its reason).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from s3ckpt.errors import LocalServerError
from s3ckpt.testing.local_s3 import DEFAULT_BUCKET, REGION
from s3ckpt.testing.netns import Link, NetnsUnavailableError, Network, alive
from s3ckpt.testing.weed import PORT_FLAGS, command, die_with_parent, find_weed, free_ports

__all__ = ["Cluster", "NetnsUnavailableError", "Node"]

MASTER_PORT = 29500  # free in the first node's own namespace
_SHM = Path("/dev/shm")
_STALE = re.compile(r"^s3ckpt-net-(\d+)-")


@dataclass
class Node:
    """One simulated node: its namespace's link, its shared-memory folder, its name."""

    index: int
    name: str
    link: Link
    shm: Path

    @property
    def address(self) -> str:
        return self.link.address

    @property
    def namespace(self) -> str:
        return self.link.namespace

    def cut(self) -> None:
        self.link.cut()

    def restore(self) -> None:
        self.link.restore()


class Cluster:
    """``nodes`` node namespaces and a storage namespace running SeaweedFS's S3, each
    linked to one switch at its rate (bytes/s, both directions); a context manager."""

    def __init__(
        self,
        nodes: int,
        *,
        node_rate: float = 25e6,
        storage_rate: float = 100e6,
        bucket: str = DEFAULT_BUCKET,
        startup_timeout: float = 30.0,
    ) -> None:
        if not 1 <= nodes <= 12:
            raise LocalServerError(f"a cluster has 1 to 12 nodes, got {nodes}")
        self.node_count = nodes
        self.node_rate, self.storage_rate = node_rate, storage_rate
        self.bucket = bucket
        self.region = REGION
        self.access_key = "S3CKPT" + secrets.token_hex(7).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self._startup_timeout = startup_timeout
        self.network = Network()
        self.nodes: list[Node] = []
        self.storage: Link | None = None
        self._dir: Path | None = None
        self._server: subprocess.Popen[bytes] | None = None
        self._s3_port = 0
        self._processes: list[subprocess.Popen[bytes]] = []

    # -- what callers use --------------------------------------------------------------

    def node(self, index: int) -> Node:
        return self.nodes[index]

    @property
    def endpoint_url(self) -> str:
        """The S3 endpoint, at the storage namespace's address."""
        if self.storage is None:
            raise LocalServerError("the cluster has not been started")
        return f"http://{self.storage.address}:{self._s3_port}"

    def env(self) -> dict[str, str]:
        """The ``AWS_*`` variables that point s3ckpt and boto3 at the storage server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }

    def options(self) -> dict[str, str]:
        """What an s3ckpt writer, reader or manager needs (``S3Config``'s names)."""
        return {
            "endpoint_url": self.endpoint_url,
            "access_key_id": self.access_key,
            "secret_access_key": self.secret_key,
            "region": self.region,
        }

    def client(self) -> Any:
        """A boto3 client for the server, over the host's unshaped link."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name=self.region,
            config=Config(
                s3={"addressing_style": "path"}, connect_timeout=2, read_timeout=10,
                retries={"max_attempts": 2, "mode": "standard"},
            ),
        )  # fmt: skip

    def popen(
        self, node: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in node ``node``'s namespace (its own process group; ended by
        :meth:`stop` if still running), with ``env`` over this process's environment."""
        full = {**os.environ, **self.env(), **(env or {})}
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.nodes[node].namespace, *argv],
            env=full, stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=die_with_parent(), **kwargs,
        )  # fmt: skip
        self._processes.append(process)
        return process

    def rank_env(self, rank: int, world: int, per_node: int) -> dict[str, str]:
        """What rank ``rank`` of ``world`` (``per_node`` on each node, in rank order) needs."""
        node = self.nodes[rank // per_node]
        return {
            "MASTER_ADDR": self.nodes[0].address,
            "MASTER_PORT": str(MASTER_PORT),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node),
            "S3CKPT_MEMORY_ROOT": str(node.shm),
            "S3CKPT_NODE": node.name,
            "GLOO_SOCKET_IFNAME": node.link.inner,  # not the address the host name resolves to
        }

    def start_ranks(
        self,
        argv: Sequence[str],
        *,
        per_node: int = 1,
        env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> list[subprocess.Popen[bytes]]:
        """One process per rank running ``argv``, ``per_node`` on each node, rank order
        node by node, each with :meth:`rank_env`."""
        world = per_node * len(self.nodes)
        return [
            self.popen(
                rank // per_node,
                argv,
                {**(env or {}), **self.rank_env(rank, world, per_node)},
                **kwargs,
            )
            for rank in range(world)
        ]

    def wait(
        self, processes: Sequence[subprocess.Popen[bytes]], timeout: float
    ) -> list[int | None]:
        """Exit statuses of ``processes`` once all ended, or None for each still running
        after ``timeout`` s (those are killed, with their process groups)."""
        deadline = time.monotonic() + timeout
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
        codes = [process.poll() for process in processes]
        for process, code in zip(processes, codes, strict=True):
            if code is None:
                _kill_group(process)
        return codes

    # -- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Cluster:
        """Make the network, the nodes' folders and the server; wait until S3 answers."""
        sweep_folders()
        atexit.register(self.stop)
        try:
            self.network.create()
            self._dir = Path(tempfile.mkdtemp(prefix=f"s3ckpt-net-{os.getpid()}-"))
            for index in range(self.node_count):
                link = self.network.add(f"node{index}", self.node_rate)
                shm = Path(tempfile.mkdtemp(prefix=f"s3ckpt-net-{os.getpid()}-", dir=_SHM))
                self.nodes.append(Node(index, f"node{index}", link, shm))
            self.storage = self.network.add("storage", self.storage_rate)
            self._start_server()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """End every process it started, remove the namespaces, links and folders;
        idempotent."""
        atexit.unregister(self.stop)
        for process in self._processes:
            _kill_group(process)
        self._processes.clear()
        if self._server is not None:
            _kill_group(self._server)
            self._server = None
        self.network.remove()
        for node in self.nodes:
            shutil.rmtree(node.shm, ignore_errors=True)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _start_server(self) -> None:
        """``weed mini`` in the storage namespace, bound to all its addresses, with a
        private /tmp (weed's unix sockets go there, named by port only)."""
        assert self._dir is not None and self.storage is not None
        weed = find_weed()
        data = self._dir / "data"
        data.mkdir()
        ports = free_ports(PORT_FLAGS)
        self._s3_port = ports["s3.port"]
        identities = self._dir / "s3-identities.json"
        identity = {
            "name": "s3ckpt-cluster",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        identities.write_text(json.dumps({"identities": [identity]}))
        # the folder is weed's /tmp: its paths are given as weed sees them
        seen = Path("/tmp")
        args = [
            "-ip.bind=0.0.0.0" if arg.startswith("-ip.bind=") else arg
            for arg in command(weed, seen / data.name, seen / identities.name, ports, None)
        ]
        # weed is opened before /tmp is covered (a venv under /tmp would vanish with it)
        # and run from that descriptor
        script = (
            f'exec 3<"$1" && mount --bind "{self._dir}" /tmp && shift && exec /proc/self/fd/3 "$@"'
        )
        with (self._dir / "weed.log").open("ab") as log:
            self._server = subprocess.Popen(
                ["ip", "netns", "exec", self.storage.namespace, "sh", "-c", script, "weed", *args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self._dir,
                start_new_session=True, preexec_fn=die_with_parent(),
            )  # fmt: skip
        self._wait_ready(time.monotonic() + self._startup_timeout)

    def _wait_ready(self, deadline: float) -> None:
        client = self.client()
        error: BaseException | None = None
        while time.monotonic() < deadline:
            assert self._server is not None
            if self._server.poll() is not None:
                raise LocalServerError(
                    f"SeaweedFS exited with status {self._server.returncode} in the storage "
                    f"namespace; log tail:\n{self.log_tail()}"
                )
            try:
                client.create_bucket(Bucket=self.bucket)
                return
            except Exception as exc:  # not listening yet, or S3 not wired to the filer yet
                code = getattr(exc, "response", {}).get("Error", {}).get("Code")
                if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    return
                error = exc
            time.sleep(0.1)
        raise LocalServerError(
            f"SeaweedFS S3 did not answer at {self.endpoint_url} within "
            f"{self._startup_timeout:.0f}s (last error: {error}); log tail:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        log = self._dir / "weed.log" if self._dir is not None else None
        if log is None or not log.exists():
            return "(no log)"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``process``'s group (what ``ip netns exec`` ran, and its children)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(10)


def sweep_folders() -> None:
    """Remove the folders (temporary and /dev/shm) of clusters whose process is gone."""
    for parent in (Path(tempfile.gettempdir()), _SHM):
        with contextlib.suppress(OSError):
            for path in parent.iterdir():
                match = _STALE.match(path.name)
                if match and not alive(int(match[1])):
                    shutil.rmtree(path, ignore_errors=True)
