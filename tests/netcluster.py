"""N machines on one host, for the cluster drill: a network namespace per node
(``ckd<tag>n<i>``, address ``10.0.0.<i>``, the runbook's own addresses) and a hub
namespace (``ckd<tag>h``) holding the bridge and the bucket's address ``10.0.0.100``;
``$DRILL_NETNS_PREFIX`` replaces ``ckd`` (several drills on one machine). Each node's
link is capped both ways with ``tc ... tbf``. Needs root and iproute2.

The addresses exist only inside these namespaces, and every link is made there
(``ip link add ... netns``): nothing is added to the host's own network. ``down``
(also at exit, and by ``with``) stops what runs in them and removes them: only ours.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import signal
import subprocess
import time
import uuid

NET = "10.0.0."
HUB_ADDRESS = NET + "100"
PREFIX = os.environ.get("DRILL_NETNS_PREFIX", "ckd")
CLONE_NEWNET = 0x40000000


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=60)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()} (the drill needs root and iproute2)")
    return done


def why_not() -> str | None:
    """None where this process may make network namespaces, else the reason it may not."""
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`); run the drill as root"
    name = f"{PREFIX}probe{os.getpid()}"
    try:
        done = ip("netns", "add", name, check=False)
    except FileNotFoundError:
        return "iproute2 (`ip`) is not installed"
    if done.returncode != 0:
        return f"`ip netns add` fails here: {done.stderr.strip()}"
    ip("netns", "del", name, check=False)
    return None


class NetCluster:
    """Nodes numbered from 1, each at ``10.0.0.<number>``; ``add(i)`` may bring a node
    back (the same address: a replacement machine) or a new number (a new address)."""

    def __init__(self, rate: str = "1gbit", tag: str | None = None, prefix: str | None = None) -> None:
        self.rate = rate
        self.tag = (PREFIX if prefix is None else prefix) + (tag or uuid.uuid4().hex[:6])
        self.hub = f"{self.tag}h"
        self.nodes: dict[int, str] = {}  # number -> namespace
        self._made: list[str] = []

    def ns(self, i: int) -> str:
        return self.nodes[i]

    @staticmethod
    def address(i: int) -> str:
        return f"{NET}{i}"

    def up(self) -> "NetCluster":
        atexit.register(self.down)
        ip("netns", "add", self.hub)
        self._made.append(self.hub)
        ip("-n", self.hub, "link", "set", "lo", "up")
        ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        ip("-n", self.hub, "addr", "add", f"{HUB_ADDRESS}/24", "dev", "br0")
        ip("-n", self.hub, "link", "set", "br0", "up")
        return self

    def _shape(self, ns: str, dev: str) -> None:
        # a bucket of 1 ms at the rate (at least 128 KiB, TSO's segment): the rate sets the pace
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", self.rate)
        if m is None:
            raise ValueError(f"rate {self.rate!r}: give it as tc writes it, such as 1gbit or 100mbit")
        bits = int(float(m[1]) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m[2]])
        burst = max(bits // 8 // 1000, 2**17)
        done = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                               "rate", self.rate, "burst", str(burst), "latency", "20ms"],
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"tc tbf on {dev} in {ns}: {done.stderr.strip()}")

    def add(self, i: int) -> str:
        """Node ``i``'s namespace, linked to the bridge at ``10.0.0.<i>``."""
        if i in self.nodes:
            raise ValueError(f"node {i} is up; remove it first")
        if not 1 <= i <= 99:
            raise ValueError(f"node number {i}: 1 to 99 (10.0.0.100 is the bucket's)")
        ns = f"{self.tag}n{i}"
        ip("netns", "add", ns)
        self._made.append(ns)
        self.nodes[i] = ns
        hub_end = f"v{i}"
        ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", hub_end, "netns", self.hub)
        ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", self.hub, "link", "set", hub_end, "master", "br0")
        ip("-n", self.hub, "link", "set", hub_end, "up")
        self._shape(ns, "eth0")
        self._shape(self.hub, hub_end)
        return ns

    def wrap(self, where: int | str) -> list[str]:
        """The command prefix that runs a program on node ``where`` (or in the hub: "hub")."""
        return ["ip", "netns", "exec", self.hub if where == "hub" else self.nodes[int(where)]]

    def popen(self, where: int | str, argv: list[str], **kw: object) -> subprocess.Popen:
        return subprocess.Popen([*self.wrap(where), *argv], **kw)  # type: ignore[call-overload]

    def run(self, where: int | str, argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run([*self.wrap(where), *argv], **kw)  # type: ignore[call-overload]

    @staticmethod
    def _pids(ns: str) -> list[int]:
        done = ip("netns", "pids", ns, check=False)
        return [int(p) for p in done.stdout.split() if p.isdigit()]

    def _stop(self, ns: str) -> None:
        """Every process in ``ns`` (ours: nothing else knows the name), TERM then KILL."""
        left = self._pids(ns)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while left and time.monotonic() < deadline:
                time.sleep(0.1)
                left = self._pids(ns)
            if not left:
                return

    def stop_all_but(self, i: int, keep: set[int]) -> None:
        """Every process on node ``i`` but the ``keep`` pids (its daemon), killed at once."""
        for _ in range(50):
            left = [pid for pid in self._pids(self.nodes[i]) if pid not in keep]
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"node {i}: processes {left} outlive SIGKILL")

    def kill(self, i: int) -> None:
        """The machine is lost: its processes killed at once, its namespace and link gone."""
        ns = self.nodes.pop(i)
        for pid in self._pids(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._stop(ns)
        ip("netns", "del", ns, check=False)
        self._made.remove(ns)

    def down(self) -> None:
        for ns in reversed(self._made):
            self._stop(ns)
            ip("netns", "del", ns, check=False)
        self._made = []
        self.nodes = {}

    def __enter__(self) -> "NetCluster":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def join_requester() -> None:
    """A process forked for another (tests/forkserver.py) joins the requester's network
    namespace, where an exec'd one would have started: call it first, before any thread
    or socket. Nothing where both are in one namespace already."""
    parent = os.getppid()  # the fork server's children: the requester's pid
    mine, theirs = "/proc/self/ns/net", f"/proc/{parent}/ns/net"
    if os.stat(mine).st_ino == os.stat(theirs).st_ino:
        return
    fd = os.open(theirs, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into the network namespace of pid {parent}")
    finally:
        os.close(fd)
