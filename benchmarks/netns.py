"""A real link between two processes on one machine: two network namespaces of this
process's own (``ckb<pid>a``, ``ckb<pid>b``) joined by a veth pair, addressed in a
private /30, each end capped by ``tc qdisc ... tbf`` at ``rate`` (the NIC a node would
have: 10gbit, 1gbit). Needs root and iproute2.

Everything made is removed by ``down`` (also called at exit, and by ``with``): the
namespaces (which takes the veth pair with them) after the processes still running
in them, which can only be this benchmark's (nothing else knows their names).
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import time

NET = "10.237.41."  # a /30 in each of our own namespaces: no other namespace sees it
A, B = NET + "1", NET + "2"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()} (the link needs root and iproute2)")
    return done


def rate_bits(rate: str) -> int:
    """``10gbit`` -> 10_000_000_000 (tc's units: kbit, mbit, gbit; bits per second)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if m is None:
        raise ValueError(f"--link {rate!r}: give a rate as tc writes it, such as 10gbit or 1gbit")
    return int(float(m[1]) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m[2]])


class Link:
    """Namespace ``a`` (address ``A``) and ``b`` (``B``), one veth pair between them,
    ``rate`` each way. ``wrap(side)``: the command prefix that runs a program there."""

    def __init__(self, rate: str = "10gbit", tag: str | None = None) -> None:
        self.rate = rate
        self.bits = rate_bits(rate)
        self.tag = tag = tag or str(os.getpid())
        self.ns = {"a": f"ckb{tag}a", "b": f"ckb{tag}b"}
        self.dev = {"a": f"ckv{tag}a", "b": f"ckv{tag}b"}  # at most 15 characters
        self.addr = {"a": A, "b": B}
        self._made: list[str] = []

    def wrap(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side]]

    def up(self) -> "Link":
        atexit.register(self.down)
        for side in "ab":
            _ip("netns", "add", self.ns[side])
            self._made.append(self.ns[side])
        _ip("link", "add", self.dev["a"], "type", "veth", "peer", "name", self.dev["b"])
        # a token bucket big enough for 1 ms at the rate (and never below 64 KiB, TSO's
        # largest segment), so that the cap, not the bucket, sets the pace
        burst = max(self.bits // 8 // 1000, 2**17)
        for side in "ab":
            ns, dev = self.ns[side], self.dev[side]
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr[side]}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            done = subprocess.run([*self.wrap(side), "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                                   self.rate, "burst", str(burst), "latency", "20ms"],
                                  capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                raise RuntimeError(f"tc tbf on {dev}: {done.stderr.strip()}")
        return self

    def pids(self) -> list[int]:
        out: list[int] = []
        for ns in self._made:
            done = _ip("netns", "pids", ns, check=False)
            out += [int(p) for p in done.stdout.split() if p.isdigit()]
        return out

    def down(self) -> None:
        """Stop what still runs in the namespaces (ours alone), then remove them."""
        left = self.pids()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while left and time.monotonic() < deadline:
                time.sleep(0.1)
                left = self.pids()
            if not left:
                break
        for ns in self._made:
            _ip("netns", "del", ns, check=False)
        self._made = []
        _ip("link", "del", self.dev["a"], check=False)  # made but not yet moved: a failure mid-way

    def __enter__(self) -> "Link":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()
