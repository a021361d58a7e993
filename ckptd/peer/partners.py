"""Which peers hold copies of a share (docs/tiers.md, "Placement"): ``ring`` (the
default) sorts every node by address and sends a node's shares ``domain``, 2·``domain``,
… places on, so that each copy lies in another failure domain; ``order``
(``"rendezvous"``) hashes (run, rank) over the peers list. Every daemon computes the
same order from the same list; the first ``replicas`` peers are a share's partners, the
rest its fallbacks.
"""

from __future__ import annotations

import functools
import ipaddress
from typing import Any, Sequence

import xxhash

from ..config import PeerConfig, split_host_port


@functools.lru_cache(maxsize=65536)
def host_of(endpoint: str) -> str:
    return split_host_port(endpoint.split("://", 1)[-1])[0]


def order(peers: tuple[str, ...] | list[str], run: str, rank: int, *, me: str = "") -> list[str]:
    """``peers`` (never ``me``) in the order a share of (``run``, ``rank``) tries them."""
    mine = host_of(me) if me else None
    others = [p for p in dict.fromkeys(peers) if p != me]
    hashed = f"{run}\0{rank}\0".encode()
    by_hash = sorted(others, key=lambda p: -xxhash.xxh3_64_intdigest(hashed + p.encode()))
    if mine is None or all(host_of(q) != mine for q in others) or all(host_of(q) == mine for q in others):
        return by_hash
    return sorted(by_hash, key=lambda p: host_of(p) == mine)  # stable: the hash order within each group


def ring(nodes: Sequence[str], me: str, jump: int) -> list[str]:
    """``nodes`` (every node, ``me`` among them) but ``me``, in the order a share of
    ``me`` tries them: ``jump``, 2·``jump``, … places after ``me`` round the ring, then
    the rest in ring order."""
    nodes = list(dict.fromkeys(nodes))
    n, i = len(nodes), nodes.index(me)
    first = dict.fromkeys(nodes[(i + k * jump) % n] for k in range(1, n))
    rest = (nodes[(i + k) % n] for k in range(1, n))
    return [p for p in dict.fromkeys([*first, *rest]) if p != me]


def _address_key(endpoint: str) -> tuple[int, Any, int]:
    """Endpoints by address: IPv4 and IPv6 numerically, names as written, then port."""
    host = host_of(endpoint)
    port = int(endpoint.rsplit(":", 1)[-1])
    try:
        return 0, int(ipaddress.ip_address(host)), port
    except ValueError:
        return 1, host, port


def cluster(config: PeerConfig) -> list[str]:
    """Every node of the ring: ``peers`` and this daemon's ``listen``, by address (the
    same list on every node whether or not its ``peers`` names itself)."""
    return sorted(dict.fromkeys([*config.peers, config.listen]), key=_address_key)


def of(config: PeerConfig, run: str, rank: int) -> list[str]:
    """The peers (never this daemon) in the order a share of (``run``, ``rank``) tries
    them, by ``[peer] placement``."""
    if config.placement == "rendezvous":
        return order(config.peers, run, rank, me=config.listen)
    return ring(cluster(config), config.listen, config.domain)
