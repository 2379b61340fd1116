"""Linux network namespaces as the nodes of a simulated cluster: creating them, joining
them by shaped links, failing those links, and removing all of it.

Each namespace is a network stack of its own (interfaces, routes, ports), so a process
started in one (``ip netns exec``) reaches the others only over the links made here: a
veth pair from the namespace to a bridge in a switch namespace. Each link is shaped in
both directions by a token-bucket qdisc (``tbf``) on each end's egress: ``rate`` bytes
per second, ``burst`` bytes. A link can be cut (the switch's end set down: packets vanish,
connections stall as over a pulled cable), restored, throttled to another rate, and two
links partitioned from each other (bridge port isolation) while both still reach the
rest.

Names carry the creating process's pid (``s3ckpt-<pid>-...``), so several harnesses run at
once, and whatever a process killed before its cleanup left behind is recognized and
removed by the next harness (:func:`sweep_stale`). Addresses come from a /28 of
100.64.0.0/10 (RFC 6598) chosen by the pid, unique among live processes; only the host's
own link into the switch carries one in the root namespace.

Needs root, ``ip`` and ``tc`` (iproute2) and the ``tbf`` qdisc; where any is missing,
:class:`NetnsUnavailableError` says which.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from s3ckpt.errors import LocalServerError

__all__ = [
    "Link",
    "NetnsUnavailableError",
    "Network",
    "check_available",
    "sweep_stale",
]

PREFIX = "s3ckpt-"  # namespace names: s3ckpt-<pid>-<role>
HOST_LINK = "s3h"  # the root namespace's end of the host link: s3h<pid>
_SPACE = ipaddress.ip_network("100.64.0.0/10")
_SUBNET_BITS = 28
_NAME = re.compile(rf"^{PREFIX}(\d+)-")
_HOST_NAME = re.compile(rf"^{HOST_LINK}(\d+)$")
_MIN_BURST = 64 << 10  # a GSO packet of a veth is up to 64 KiB
_live: set[int] = set()  # pids of this process's networks that are up


class NetnsUnavailableError(LocalServerError):
    """Network namespaces, veth links or ``tbf`` cannot be used here (not root, no
    iproute2, a kernel without them); the message says which."""


def ip(*args: str, namespace: str | None = None, check: bool = True) -> str:
    """Run ``ip`` (in ``namespace``); its output, or :class:`NetnsUnavailableError`."""
    return _run(["ip", *(("-n", namespace) if namespace else ()), *args], check=check)


def tc(namespace: str, *args: str) -> str:
    return _run(["ip", "netns", "exec", namespace, "tc", *args])


def _run(argv: Sequence[str], *, check: bool = True) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise NetnsUnavailableError(
            f"`{' '.join(argv)}` failed (status {done.returncode}): {done.stderr.strip()}"
        )
    return done.stdout


def check_available() -> None:
    """Raise :class:`NetnsUnavailableError` unless this process can make namespaces."""
    if not os.path.exists("/proc/self/ns/net"):
        raise NetnsUnavailableError("network namespaces need Linux")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsUnavailableError(f"{' and '.join(missing)} (iproute2) not found on PATH")
    if os.geteuid() != 0:
        raise NetnsUnavailableError("creating network namespaces needs root")


def subnet_of(pid: int) -> ipaddress.IPv4Network:
    """The /28 of ``pid``'s harness (unique among live pids)."""
    size = 1 << (32 - _SUBNET_BITS)
    count = _SPACE.num_addresses // size
    if pid >= count:
        raise NetnsUnavailableError(f"pid {pid} is beyond the {count} subnets of {_SPACE}")
    return ipaddress.ip_network(f"{_SPACE.network_address + pid * size}/{_SUBNET_BITS}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def kill_inside(namespace: str) -> None:
    """SIGKILL every process in ``namespace``."""
    for pid in ip("netns", "pids", namespace, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def delete_namespace(namespace: str) -> None:
    """End its processes and delete it (its links go with it); idempotent."""
    kill_inside(namespace)
    for _ in range(50):
        if namespace not in namespaces():
            return
        ip("netns", "delete", namespace, check=False)
        if namespace not in namespaces():
            return
        time.sleep(0.1)  # a process still exiting holds it


def sweep_stale(pids: Sequence[int] = ()) -> list[str]:
    """Remove the namespaces and host links of harnesses whose process is gone (or whose
    pid is in ``pids``: this process's, left by a dead one that had its pid); what was
    removed."""
    removed = []
    for name in namespaces():
        match = _NAME.match(name)
        if match and (int(match[1]) in pids or not alive(int(match[1]))):
            delete_namespace(name)
            removed.append(name)
    for line in ip("-o", "link", "show").splitlines():
        fields = line.split(":")
        link = fields[1].strip().split("@")[0] if len(fields) > 1 else ""
        match = _HOST_NAME.match(link)
        if match and (int(match[1]) in pids or not alive(int(match[1]))):
            ip("link", "delete", link, check=False)
            removed.append(link)
    return removed


@dataclass
class Link:
    """One endpoint's link into the switch: ``inner`` (``eth0`` in ``namespace``) and
    ``port`` (its peer on the switch's bridge), each shaped on egress."""

    network: Network
    namespace: str
    port: str
    address: str
    rate: float  # bytes per second, both directions
    burst: int
    inner: str = "eth0"
    up: bool = True
    _flapping: threading.Event | None = field(default=None, repr=False)

    def shape(self, rate: float, burst: int | None = None) -> None:
        """Set both directions to ``rate`` bytes/s (``burst`` bytes; default: 10 ms of it,
        at least 64 KiB)."""
        self.rate, self.burst = rate, burst or default_burst(rate)
        for namespace, device in ((self.namespace, self.inner), (self.network.switch, self.port)):
            tc(namespace, "qdisc", "replace", "dev", device, "root", *tbf(self.rate, self.burst))

    def throttle(self, fraction: float) -> None:
        """Change the rate to ``fraction`` of what it is now, mid-transfer."""
        self.shape(self.rate * fraction)

    def cut(self) -> None:
        """Pull the cable: the switch's end goes down, packets both ways vanish; open
        connections stall until it is restored (or they time out)."""
        ip("link", "set", self.port, "down", namespace=self.network.switch)
        self.up = False

    def restore(self) -> None:
        ip("link", "set", self.port, "up", namespace=self.network.switch)
        self.up = True

    def flap(self, down_s: float, up_s: float, times: int | None = None) -> threading.Event:
        """Cut and restore the link in turn, ``down_s`` down and ``up_s`` up, ``times``
        times (None: until the returned event is set, or :meth:`stop_flapping`), in a
        thread; it ends restored."""
        stop = threading.Event()
        self._flapping = stop

        def run() -> None:
            n = 0
            try:
                while not stop.is_set() and (times is None or n < times):
                    self.cut()
                    stop.wait(down_s)
                    self.restore()
                    n += 1
                    stop.wait(up_s)
            except NetnsUnavailableError:  # the network was removed under the thread
                return

        threading.Thread(target=run, name=f"flap-{self.port}", daemon=True).start()
        return stop

    def stop_flapping(self) -> None:
        stop, self._flapping = self._flapping, None
        if stop is not None:
            stop.set()
            time.sleep(0.05)
            with contextlib.suppress(NetnsUnavailableError):
                self.restore()

    def isolate(self, on: bool = True) -> None:
        """Bridge port isolation: isolated ports reach no other isolated port, and every
        port that is not (see :meth:`Network.partition`)."""
        _run(
            ["ip", "netns", "exec", self.network.switch, "bridge", "link", "set",
             "dev", self.port, "isolated", "on" if on else "off"]
        )  # fmt: skip


def default_burst(rate: float) -> int:
    return max(_MIN_BURST, int(rate / 100))


def tbf(rate: float, burst: int) -> list[str]:
    """``tbf`` arguments: ``rate`` bytes/s, ``burst`` bytes, a queue of 100 ms."""
    return ["tbf", "rate", f"{int(rate * 8)}bit", "burst", str(burst), "latency", "100ms"]


class Network:
    """A switch namespace with a bridge, endpoint namespaces linked to it, and the host's
    own unshaped link into it (its address is :attr:`host_address`)."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.subnet = subnet_of(self.pid)
        self.switch = f"{PREFIX}{self.pid}-switch"
        self.host_link = f"{HOST_LINK}{self.pid}"
        self._hosts = iter(self.subnet.hosts())
        self.host_address = str(next(self._hosts))
        self.links: dict[str, Link] = {}
        self.namespaces: list[str] = []

    def create(self) -> None:
        """The switch, its bridge and the host link. Stale harnesses' leftovers (and this
        pid's, from a dead process) are removed first. One network per process at a time
        (its names and addresses are the pid's)."""
        check_available()
        if self.pid in _live:
            raise NetnsUnavailableError(
                f"process {self.pid} already has a network up: remove it before making another"
            )
        sweep_stale([self.pid])
        _live.add(self.pid)
        self._add_namespace(self.switch)
        ip("link", "add", "br0", "type", "bridge", namespace=self.switch)
        ip("link", "set", "br0", "up", namespace=self.switch)
        ip("link", "set", "lo", "up", namespace=self.switch)
        ip("link", "add", self.host_link, "type", "veth", "peer", "name", "host", "netns",
           self.switch)  # fmt: skip
        ip("link", "set", "host", "master", "br0", "up", namespace=self.switch)
        ip("addr", "add", f"{self.host_address}/{_SUBNET_BITS}", "dev", self.host_link)
        ip("link", "set", self.host_link, "up")

    def add(self, role: str, rate: float, burst: int | None = None) -> Link:
        """A namespace ``s3ckpt-<pid>-<role>`` linked to the switch at ``rate`` bytes/s."""
        namespace = f"{PREFIX}{self.pid}-{role}"
        port = f"p{len(self.links)}"
        try:
            address = str(next(self._hosts))
        except StopIteration:
            raise NetnsUnavailableError(f"no address left in {self.subnet}") from None
        self._add_namespace(namespace)
        ip("link", "set", "lo", "up", namespace=namespace)
        ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", namespace,
           namespace=self.switch)  # fmt: skip
        ip("link", "set", port, "master", "br0", "up", namespace=self.switch)
        ip("addr", "add", f"{address}/{_SUBNET_BITS}", "dev", "eth0", namespace=namespace)
        ip("link", "set", "eth0", "up", namespace=namespace)
        link = Link(self, namespace, port, address, rate, burst or default_burst(rate))
        link.shape(rate, burst)
        self.links[role] = link
        return link

    def partition(self, a: str, b: str) -> None:
        """``a`` and ``b`` reach each other no more; both still reach every other link
        (isolated bridge ports)."""
        self.links[a].isolate(True)
        self.links[b].isolate(True)

    def heal(self) -> None:
        """Undo every partition."""
        for link in self.links.values():
            link.isolate(False)

    def remove(self) -> None:
        """Every namespace, process inside and link of this network; idempotent."""
        for link in self.links.values():
            if link._flapping is not None:
                link._flapping.set()
        for namespace in reversed(self.namespaces):
            delete_namespace(namespace)
        self.namespaces.clear()
        ip("link", "delete", self.host_link, check=False)
        _live.discard(self.pid)

    def _add_namespace(self, namespace: str) -> None:
        ip("netns", "add", namespace)
        self.namespaces.append(namespace)
