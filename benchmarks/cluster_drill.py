"""The cluster drill, from one command, as root:

    .venv/bin/python benchmarks/cluster_drill.py                 # 4 nodes, 60 steps, all set-ups
    .venv/bin/python benchmarks/cluster_drill.py --setups peers --nodes 2 --steps 8

ckptd from a wheel of this checkout in a fresh venv, each node a network namespace set up
by docs/runbook.md's own commands, a torchrun FSDP2 job saving every step with
``keep_last = 3``, a node lost and replaced at the same and at a new address
(tests/clusterdrill.py). Prints each node's disk and peer memory over the run, the
recovery time of each case, and every sample past a bound; exits 1 if any bound or
comparison fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import clusterdrill  # noqa: E402  (tests/ is on sys.path above)
import netcluster  # noqa: E402


def timeline(result: dict, width: int = 12) -> list[str]:
    """Each node's disk and held peer memory at up to ``width`` evenly spaced samples."""
    lines = []
    for node in sorted({s.node for s in result["samples"]}):
        mine = [s for s in result["samples"] if s.node == node]
        picked = mine[:: max(1, len(mine) // width)]
        lines.append(f"  n{node} disk KiB: " + " ".join(f"{s.disk // 1024}" for s in picked))
        lines.append(f"  n{node} held KiB: " + " ".join("-" if s.held is None else f"{s.held // 1024}" for s in picked))
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default=",".join(clusterdrill.SETUPS), help="comma-separated: peers,bucket,both")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-at", type=int, default=30, help="a node is lost once this step is complete")
    p.add_argument("--addresses", default="same,new", help="where the replacement comes up: same,new")
    p.add_argument("--rate", default="1gbit", help="each node's link, as tc writes it")
    p.add_argument("--every", type=float, default=2.0, help="seconds between samples of each node")
    p.add_argument("--base", type=Path, help="a folder to keep everything in (default: a temporary one)")
    args = p.parse_args()
    reason = netcluster.why_not()
    if reason:
        print(f"cluster_drill: {reason}", file=sys.stderr)
        return 2
    base = args.base or Path(tempfile.mkdtemp(prefix="ckptd-drill-"))
    venv = clusterdrill.wheel_venv(base)
    server, forks = clusterdrill.fork_server(venv, Path(tempfile.mkdtemp(prefix="ckdf", dir="/tmp")))
    failed, ref = False, None
    try:
        for setup in args.setups.split(","):  # the uninterrupted run once: the job does not depend on the tiers
            r = clusterdrill.drill(base, venv, setup, nodes=args.nodes, steps=args.steps, kill_at=args.kill_at,
                                   addresses=tuple(args.addresses.split(",")), rate=args.rate, every=args.every,
                                   ref=ref, forks=forks)
            ref = r["ref"]
            failed |= report(setup, r)
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(Path(forks).parent, ignore_errors=True)
    print("\nrunbook substitutions:\n" + "\n".join(f"  - {s}" for s in clusterdrill.SUBSTITUTIONS))
    return 1 if failed else 0


def report(setup: str, r: dict) -> bool:
    """Prints one set-up's figures; whether a bound or a comparison failed."""
    failed = False
    print(f"\n== {setup}: {r['nodes']} nodes, {r['steps']} steps, {r['seconds']} s in all")
    print(f"  seconds by phase: {r['times']}")
    print(f"  each launch: {r['jobs']}")
    print("\n".join(timeline(r)))
    print(json.dumps(r["figures"]))
    for c in r["cases"]:
        print(f"  replacement at the {c['address']} address: set up in {c['replace_s']} s, job resumed "
              f"{c['resume_s']} s later from step(s) {c['resumed_from']} (newest on the survivors: {c['newest_when_lost']}); "
              f"differs from the uninterrupted run in {len(c['differ'])} tensor(s) {c['differ'][:5]}")
        failed |= bool(c["differ"]) or len(c["resumed_from"]) != 1 or not c["newest_when_lost"] \
            or not c["newest_when_lost"] <= c["resumed_from"][0] <= c["handed_over_when_lost"]
    print(f"  {len(r['violations'])} sample(s) past a bound" + "".join(f"\n    {v}" for v in r["violations"][:10]))
    failed |= bool(r["violations"])
    return failed


if __name__ == "__main__":
    sys.exit(main())
