"""TCP ports for servers the tests start (daemons' ports, SeaweedFS), chosen so that
nothing else on the machine takes them between the choice and the server's bind.

A port from ``bind(port 0)`` comes from the kernel's ephemeral range, the same range
every outgoing connection takes its local port from: a ZeroMQ peer link, an S3 request
or a torchrun store of a test running beside this one can take it in the moment before
the daemon binds it ("Address already in use": one CI run in several). So ports come
from below that range, where the kernel never assigns one, in a block of its own for
each pytest-xdist worker, checked free by a bind.
"""

from __future__ import annotations

import os
import random
import socket

LOWEST = 10000  # well clear of the ports system services listen on
BLOCKS = 16  # the most pytest-xdist workers told apart; more share blocks, still checked
GAP = 10000  # SeaweedFS's gRPC port is its HTTP port + 10000 (tests/seaweed.py)
PAIRS = 2048  # the ports whose port + GAP, up to the ephemeral range, is kept for pairs


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _worker_block(region: range) -> range:
    size = len(region) // BLOCKS
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) % BLOCKS if worker.isdigit() else 0
    return region[index * size:(index + 1) * size]


class _Ports:
    """Hands out the ports of one block in turn from a random start (another pytest
    session on the machine likely starts elsewhere), each checked free by a bind."""

    def __init__(self, block: range, gap: int) -> None:
        self.block, self.gap = block, gap
        self.next = random.randrange(len(block))

    def take(self) -> int:
        for _ in range(len(self.block)):
            port = self.block[self.next % len(self.block)]
            self.next += 1
            if _free(port) and (not self.gap or _free(port + self.gap)):
                return port
        raise RuntimeError(f"no free port in {self.block.start}..{self.block.stop - 1} on 127.0.0.1")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False  # listened on, or a closed connection's TIME_WAIT on it
        return True


# Below the ephemeral range, from the top: [pairs' + GAP][...][pairs][singles]; a
# machine whose range starts low gets what is left, still checked by a bind.
_TOP = max(_ephemeral_low(), LOWEST + GAP + PAIRS + BLOCKS * 64)
_SINGLES = _Ports(_worker_block(range(LOWEST, _TOP - GAP - PAIRS)), 0)
_PAIRS = _Ports(_worker_block(range(_TOP - GAP - PAIRS, _TOP - GAP)), GAP)


def free_port() -> int:
    """A port of this worker's block, free now, and not handed out by this process
    lately (a daemon restarted on its old port finds it still its own)."""
    return _SINGLES.take()


def free_port_pair() -> int:
    """A port P such that P and P + GAP are both free now (SeaweedFS's HTTP and gRPC)."""
    return _PAIRS.take()
