"""Where replicas go, simulated to thousands of nodes: for each placement, cluster size,
``replicas`` and number of nodes lost at once, the fraction of failures after which the
newest step cannot be recovered from peers' memory, the most bytes one surviving node
sends during the recovery, and its time at a given link speed.

Placements (the real code of ``ckptd/peer/partners.py`` where it is ckptd's):

- ``rendezvous``: ``partners.order`` over every node's endpoint, per (run, rank);
- ``pairs``: whole-node groups of ``replicas`` + 1 consecutive nodes holding each
  other's shares (NVIDIA's resiliency extension with ``replication_jump`` = ranks per
  node: its cliques are then whole nodes);
- ``ring``: ``partners.ring`` with ``jump`` = nodes per failure domain, each replica in
  another domain (NVIDIA's extension with ``replication_jump`` = ranks per domain).

Failures: ``random``, k nodes anywhere; ``domain``, k nodes of one failure domain (a
rack or switch that fails takes several nodes with it). Nodes are numbered domain by
domain, ``domain`` nodes each, as ``[peer] peers`` lists them for ``ring``.

A lost node's share is recovered from the first of its ``replicas`` partners still
alive; each replacement node receives its node's ``ranks`` shares over its own link,
so a recovery takes at least ``ranks`` × share / link; a surviving node that serves
shares of several lost nodes takes longer. Random failures are sampled (``--trials``
per cell, every combination where there are fewer); the table says how many.

    python benchmarks/peer_sim.py                      # the default table (docs/tiers.md)
    python benchmarks/peer_sim.py --nodes 16,64 --share 2GiB --link 200Gb
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptd.config import parse_size  # noqa: E402
from ckptd.peer import partners  # noqa: E402

Placement = Callable[[int, int], list[int]]  # (node, local rank) -> partner nodes, in order


def endpoint(i: int) -> str:
    return f"tcp://10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:7701"


class Orders:
    """The placements' orders of one cluster, each computed once (rendezvous costs a
    hash of every node per share)."""

    def __init__(self, n: int, ranks: int, domain: int) -> None:
        self.nodes = [endpoint(i) for i in range(n)]
        self.index = {e: i for i, e in enumerate(self.nodes)}
        self.ranks, self.domain = ranks, domain
        self.cache: dict[tuple[str, int, int], list[int]] = {}

    def rendezvous(self, node: int, lrank: int) -> list[int]:
        key = ("r", node, lrank)
        if key not in self.cache:
            order = partners.order(self.nodes, "job", node * self.ranks + lrank, me=self.nodes[node])
            self.cache[key] = [self.index[p] for p in order[:3]]
        return self.cache[key]

    def ring(self, node: int) -> list[int]:
        key = ("g", node, 0)
        if key not in self.cache:
            self.cache[key] = [self.index[p] for p in partners.ring(self.nodes, self.nodes[node], self.domain)[:3]]
        return self.cache[key]


def placements(orders: Orders, replicas: int) -> dict[str, Placement]:
    n = len(orders.nodes)

    def rendezvous(node: int, lrank: int) -> list[int]:
        return orders.rendezvous(node, lrank)[:replicas]

    def pairs(node: int, lrank: int) -> list[int]:
        size = replicas + 1
        base = node // size * size
        group = [m for m in range(base, min(base + size, n)) if m != node]
        return group or [(node + 1) % n]  # a last node alone: its neighbour

    def ring(node: int, lrank: int) -> list[int]:
        return orders.ring(node)[:replicas]

    return {"rendezvous": rendezvous, "pairs": pairs, "ring": ring}


def failures(n: int, k: int, domain: int, kind: str, trials: int, rng: random.Random) -> tuple[list[tuple[int, ...]], str]:
    """The sets of k nodes lost at once to try, and how they were chosen."""
    if kind == "domain":
        if k > domain:
            return [], "-"
        domains = [list(range(d, min(d + domain, n))) for d in range(0, n, domain)]
        every = [c for members in domains for c in itertools.combinations(members, k)]
        if len(every) <= trials:
            return every, "all"
        return [tuple(rng.sample(rng.choice(domains), k)) for _ in range(trials)], f"{trials}"
    if math.comb(n, k) <= trials:
        return list(itertools.combinations(range(n), k)), "all"
    return [tuple(rng.sample(range(n), k)) for _ in range(trials)], f"{trials}"


def estimate(name: str, place: Placement, lost_sets: list[tuple[int, ...]], n: int, k: int, ranks: int) -> float:
    """The fraction lost with ``replicas`` = 1 and k random nodes lost, from q, the
    chance that two random nodes lose the step (one holds a share of the other), over
    the C(k, 2) pairs of lost nodes: where few tries see a loss, this says more than they
    do. For a node u of those tried, with D(u) the nodes holding its shares: q = (2|D(u)|
    - |{v in D(u): u in D(v)}|) / (n - 1) (as many nodes hold a share of u as u holds
    shares of, and a mutual partner counts once); rendezvous' mutual partners are
    rare enough at scale to count none (its hash would cost a node's ranks per v)."""
    nodes = sorted({u for lost in lost_sets for u in lost})[:200]
    total = 0.0
    for u in nodes:
        held = {place(u, r)[0] for r in range(ranks)}
        mutual = 0 if name == "rendezvous" else sum(u in {place(v, r)[0] for r in range(ranks)} for v in held)
        total += 2 * len(held) - mutual
    q = min(1.0, total / len(nodes) / (n - 1))
    return 1 - (1 - q) ** math.comb(k, 2)


def cell(place: Placement, lost_sets: list[tuple[int, ...]], ranks: int, share: int, link: float) -> dict[str, float]:
    lost_steps, worst_send, times = 0, 0.0, []
    for lost in lost_sets:
        gone = set(lost)
        served: dict[int, int] = {}
        ok = True
        for node in lost:
            for lrank in range(ranks):
                alive = [p for p in place(node, lrank) if p not in gone]
                if not alive:
                    ok = False
                    break
                served[alive[0]] = served.get(alive[0], 0) + 1
            if not ok:
                break
        if not ok:
            lost_steps += 1
            continue
        send = max(served.values()) * share
        worst_send = max(worst_send, send)
        times.append(max(send, ranks * share) / link)
    return {"lost": lost_steps / len(lost_sets) if lost_sets else math.nan, "send": worst_send,
            "time": max(times) if times else math.nan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="16,64,256,1024,4096")
    ap.add_argument("--ranks", type=int, default=8, help="ranks (GPUs) a node")
    ap.add_argument("--domain", type=int, default=8, help="nodes a failure domain (rack, switch)")
    ap.add_argument("--share", default="2GiB", help="bytes of one rank's share")
    ap.add_argument("--link", default="100Gb", help="each node's link, bits/s (Gb) or bytes/s (GiB)")
    ap.add_argument("--trials", type=int, default=200, help="failures tried per cell (sampled; fewer from 512 "
                    "nodes: 200 x 256 / nodes, at least 20)")
    ap.add_argument("--seed", type=int, default=30)
    args = ap.parse_args()
    share = parse_size(args.share)
    link = float(args.link[:-2]) * 1e9 / 8 if args.link.endswith("Gb") else float(parse_size(args.link))
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    print(f"{args.ranks} ranks a node, {args.domain} nodes a failure domain, a share of {args.share}, "
          f"a link of {args.link}/s; 'lost': failures after which the newest step is not in peers' memory\n")
    print("| nodes | failure | k lost | tried | placement | lost, replicas=1 | (estimate) | lost, replicas=2 "
          "| most sent by one node (r=1) | recovery time (r=1) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in (int(v) for v in args.nodes.split(",")):
        orders = Orders(n, args.ranks, args.domain)
        places = {r: placements(orders, r) for r in (1, 2)}
        trials = max(20, min(args.trials, args.trials * 256 // n))  # rendezvous: a hash per node per share
        for kind in ("random", "domain"):
            for k in (1, 2, 3):
                sets, tried = failures(n, k, args.domain, kind, trials, rng)
                if not sets:
                    continue
                for name in ("rendezvous", "pairs", "ring"):
                    one = cell(places[1][name], sets, args.ranks, share, link)
                    two = cell(places[2][name], sets, args.ranks, share, link)
                    est = f"{estimate(name, places[1][name], sets, n, k, args.ranks):.2%}" if kind == "random" else "-"
                    print(f"| {n} | {kind} | {k} | {tried} | {name} | {one['lost']:.2%} | {est} | {two['lost']:.2%} "
                          f"| {one['send'] / 2**30:.0f} GiB | {one['time']:.1f} s |", flush=True)
    print(f"\n({time.monotonic() - t0:.1f} s)")


if __name__ == "__main__":
    main()
