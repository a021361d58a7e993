"""Which peers hold a share: rendezvous hashing of (run, rank) over the peers list.

Every daemon computes the same order from the same list, with no coordination; a
node's ranks land on different peers, so that its recovery fans in from several;
and when one peer leaves the list only the shares it held move. The first
``replicas`` peers of the order are a share's partners, the rest its fallbacks.
Peers on this daemon's own host come last when other hosts are listed (another
failure domain first).
"""

from __future__ import annotations

import xxhash

from ..config import split_host_port


def host_of(endpoint: str) -> str:
    return split_host_port(endpoint.split("://", 1)[-1])[0]


def order(peers: tuple[str, ...] | list[str], run: str, rank: int, *, me: str = "") -> list[str]:
    """``peers`` (never ``me``) in the order a share of (``run``, ``rank``) tries them."""
    mine = host_of(me) if me else None
    others = [p for p in dict.fromkeys(peers) if p != me]
    return sorted(others, key=lambda p: (host_of(p) == mine and any(host_of(q) != mine for q in others),
                                         -xxhash.xxh3_64_intdigest(f"{run}\0{rank}\0{p}".encode())))
