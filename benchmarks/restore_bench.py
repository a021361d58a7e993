"""Restores that read each unique byte once (docs/performance.md, "Read once"): DDP on
``--nodes`` nodes of ``--ranks`` ranks restores a step complete only in the bucket.
Every node and the bucket (SeaweedFS) is a network namespace of this process's own
behind a ``tc``-shaped link of ``--link`` each way (tests/netcluster.py). Three ways, in
one run, each on empty roots:

    direct   every rank reads the bucket itself (no daemon serves it): the floor
    node     each node's daemon lands each share once (``fetch``), no ``[peer]``
    cluster  the daemons' ``[peer]`` list: each share read from the bucket once, by its
             fetcher, and copied from there by the other nodes (``pull``)

For each: bucket bytes served (the bucket namespace's eth0 TX counter: the server's own
view) ÷ unique bytes, and the restore time (go to the last rank done) against the
slower of the bucket's and a node's link (unique bytes ÷ the rate); each rank has
imported what a load uses before the go (tests/read_once_job.py ``warm``). Every rank's
tensors are compared with the saved ones (SHA-256). Needs root and iproute2; the
namespaces are named ``$DRILL_NETNS_PREFIX`` (else ``readonce``) and a random tag.

    sudo .venv/bin/python benchmarks/restore_bench.py [--nodes 4] [--ranks 2] [--mib 64] [--link 200mbit]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import seaweed  # noqa: E402
from netcluster import NetCluster, why_not  # noqa: E402

BUCKET_NODE = 50
RUN, STEP = "restore", 1
URL = "s3://ckptd/restore"
MODES = ("direct", "node", "cluster")
PEER_PORT = 7701
EPHEMERAL_PORT = 45000
JOB = REPO / "tests" / "read_once_job.py"


def state(mib: int) -> dict[str, Any]:
    """The model and its Adam moments as DDP saves them: the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(1)
    n = mib * 2**20 // 4 // 16
    return {"model": {f"l{i}.weight": torch.randn(n, generator=g) for i in range(8)},
            "optim": {f"l{i}.exp_avg": torch.randn(n, generator=g) for i in range(8)}}


class BucketServer(seaweed.SeaweedS3):
    """``weed mini`` in the bucket's namespace, on its address. Its ports lie in the
    kernel's ephemeral range, where tests/ports.py never puts a server: weed names its
    local sockets ``/tmp/seaweedfs-*-grpc-PORT.sock``, shared with every namespace, and
    a SeaweedFS of the host on the same port number would take them over."""

    def __init__(self, base: Path, net: NetCluster) -> None:
        super().__init__(base)
        self.ports = {name: EPHEMERAL_PORT + i for i, name in enumerate(self.ports)}
        self.address = net.address(BUCKET_NODE)
        self.wrapper = net.wrap(BUCKET_NODE)
        self.endpoint = f"http://{self.address}:{self.ports['s3']}"

    def command(self) -> list[str]:
        swap = {"-ip=127.0.0.1": f"-ip={self.address}", "-ip.bind=127.0.0.1": "-ip.bind=0.0.0.0"}
        return [*self.wrapper, *(swap.get(a, a) for a in super().command())]

    def launch(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=2, help="ranks per node")
    ap.add_argument("--mib", type=int, default=64, help="the state's size")
    ap.add_argument("--link", default="200mbit", help="each node's and the bucket's link, each way")
    ap.add_argument("--modes", default=",".join(MODES), help="which ways, in this order (default: all)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--logs", help="copy each daemon's log (at debug) here, as MODE-nN.log")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        return {"seed": seed, "restore": restore}[args.role](json.loads(args.spec))
    why = why_not()
    if why is not None:
        print(f"restore_bench: {why}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="readonce-bench-"))
    try:
        figures = drive(args, work)
    finally:
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            for log in work.glob("*/n*/daemon.log"):
                shutil.copy(log, Path(args.logs) / f"{log.parent.parent.name}-{log.parent.name}.log")
        shutil.rmtree(work, ignore_errors=True)
    report(figures)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


def drive(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from read_once_job import digests, flatten

    want = digests(flatten(state(args.mib)))
    figures: dict[str, Any] = {"nodes": args.nodes, "ranks": args.ranks, "mib": args.mib, "link": args.link,
                               "load": os.getloadavg()[0], "modes": {}}
    with NetCluster(args.link, prefix=os.environ.get("DRILL_NETNS_PREFIX", "readonce")) as net:
        for i in range(1, args.nodes + 1):
            net.add(i)
        net.add(BUCKET_NODE)
        s3 = BucketServer(work / "s3", net)
        s3.launch()
        try:
            env = {**os.environ, **s3.env(), "PYTHONPATH": str(REPO)}
            spec = {"work": str(work), "endpoint": s3.endpoint, "world": args.nodes * args.ranks, "mib": args.mib,
                    "log_level": "debug" if args.logs else "info"}
            _role(net, 1, "seed", spec, env)
            figures["unique_bytes"] = unique = json.loads((work / "unique.json").read_text())
            for mode in args.modes.split(","):
                figures["modes"][mode] = m = _restore_all(net, args, work, mode, spec, env, want, unique)
                print(f"{mode}: {json.dumps({k: v for k, v in m.items() if k != 'daemons'})}", flush=True)
        finally:
            s3.cleanup()
    figures["load_after"] = os.getloadavg()[0]
    return figures


def _role(net: NetCluster, node: int, role: str, spec: dict[str, Any], env: dict[str, str]) -> subprocess.Popen:
    argv = [sys.executable, __file__, "--role", role, "--spec", json.dumps(spec)]
    proc = net.popen(node, argv, env=env)
    if role == "seed" and proc.wait(600) != 0:
        raise RuntimeError("seeding the bucket failed")
    return proc


def _tx_bytes(net: NetCluster) -> int:
    done = net.run(BUCKET_NODE, ["ip", "-s", "-j", "link", "show", "eth0"], check=True)
    return int(json.loads(done.stdout)[0]["stats64"]["tx"]["bytes"])


def _restore_all(net: NetCluster, args: argparse.Namespace, work: Path, mode: str, spec: dict[str, Any],
                 env: dict[str, str], want: dict[str, str], unique: int) -> dict[str, Any]:
    folder = work / mode
    folder.mkdir()
    nodes = range(1, args.nodes + 1)
    procs = [_role(net, i, "restore", {**spec, "mode": mode, "node": i, "nodes": args.nodes, "ranks": args.ranks},
                   env) for i in nodes]
    deadline = time.monotonic() + 900  # every rank's imports done: minutes on a loaded machine
    while not all((folder / f"ready-{i}").exists() for i in nodes):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"{mode}: the nodes did not get ready")
        time.sleep(0.1)
    before = _tx_bytes(net)
    go = time.time()
    (folder / "go").touch()
    for p in procs:
        if p.wait(900) != 0:
            raise RuntimeError(f"{mode}: a node's restore failed")
    served = _tx_bytes(net) - before
    results = [json.loads((folder / f"node-{i}.json").read_text()) for i in nodes]
    bad = [r["rank"] for n in results for r in n["ranks"] if r["tensors"] != want]
    if bad:
        raise RuntimeError(f"{mode}: rank(s) {bad} read other bytes than were saved")
    seconds = max(r["seconds"] for n in results for r in n["ranks"])
    ideal = unique * 8 / _bits(args.link)
    return {"served_bytes": served, "served_ratio": served / unique, "seconds": seconds,
            "ideal_seconds": ideal, "link_fraction": ideal / seconds, "go": go,
            "ranks_began_ended": [[round(r["began"] - go, 3), round(r["ended"] - go, 3)] for n in results
                                  for r in n["ranks"]],
            "daemons": [n["fetched"] for n in results]}


def _bits(rate: str) -> int:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from netns import rate_bits

    return rate_bits(rate)


# -- what runs inside a node's namespace ----------------------------------------------------
def _wait_s3(endpoint: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(endpoint + "/", timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def seed(spec: dict[str, Any]) -> int:
    """Node 1: the bucket made, the state saved by ``world`` ranks (replicated) and uploaded."""
    from ckptd import Producer
    from ckptd.daemon.launcher import ServeProcess
    from ckptd.remote import catalog
    from ckptd.remote.store import Store

    work = Path(spec["work"])
    _wait_s3(spec["endpoint"])
    seaweed.make_bucket(SimpleNamespace(endpoint=spec["endpoint"]), "ckptd")  # type: ignore[arg-type]
    d = ServeProcess(work / "writer", {"daemon": {"nice": 0, "chunk_size": "8MiB"},
                                       "remote": {"url": URL, "part_bytes": "8MiB"}})
    os.environ["CKPTD_CONFIG"] = str(d.config)
    d.start()
    world = spec["world"]
    producers = [Producer(d.endpoint, RUN, rank=r, world_size=world, staging_size="256MiB", timeout=60)
                 for r in range(world)]
    try:
        full = state(spec["mib"])
        for h in [p.save(full, STEP, replicated=True) for p in producers]:
            h.wait(300)
        producers[0].wait_complete(STEP, timeout=600)
    finally:
        for p in producers:
            p.close()
        d.close()
    objects = Store(URL).list(catalog.step_prefix(RUN, STEP))
    unique = sum(n for k, n in objects.items() if not k.rsplit("/", 1)[-1].startswith("manifest"))
    (work / "unique.json").write_text(json.dumps(unique))
    return 0


def restore(spec: dict[str, Any]) -> int:
    """One node: its daemon (none for ``direct``), its ranks started and waiting for
    ``go``; then what each read and how long it took, and the daemon's figures."""
    from ckptd.daemon.launcher import ServeProcess

    folder = Path(spec["work"]) / spec["mode"]
    i, nodes, ranks = spec["node"], spec["nodes"], spec["ranks"]
    tables: dict[str, dict[str, Any]] = {"daemon": {"nice": 0, "log_level": spec["log_level"]},
                                         "remote": {"url": URL}}
    if spec["mode"] == "cluster":
        tables["peer"] = {"listen": f"tcp://10.0.0.{i}:{PEER_PORT}", "allow_plaintext": True,
                          "peers": [f"tcp://10.0.0.{j}:{PEER_PORT}" for j in range(1, nodes + 1) if j != i]}
    d = ServeProcess(folder / f"n{i}", tables)
    if spec["mode"] != "direct":
        d.start()
    env = {**os.environ, "CKPTD_CONFIG": str(d.config), "WORLD_SIZE": str(spec["world"]),
           "READ_ONCE_GO": str(folder / "go")}
    outs = [folder / f"n{i}-r{r}.json" for r in range(ranks)]
    procs = [subprocess.Popen([sys.executable, str(JOB), "load", RUN, str(out)],
                              env={**env, "RANK": str((i - 1) * ranks + r)}) for r, out in enumerate(outs)]
    try:
        while not all(Path(f"{out}.ready").exists() for out in outs):
            if any(p.poll() is not None for p in procs):
                return 1
            time.sleep(0.05)
        (folder / f"ready-{i}").touch()
        if any(p.wait() != 0 for p in procs):
            return 1
        fetched = d.status()["fetched"] if d.alive() else None
    finally:
        d.close()
    done = [{"rank": (i - 1) * ranks + r, **json.loads(out.read_text())} for r, out in enumerate(outs)]
    (folder / f"node-{i}.json").write_text(json.dumps({"ranks": done, "fetched": fetched}))
    return 0


def report(f: dict[str, Any]) -> None:
    unique = f["unique_bytes"]
    print(f"restore_bench: {f['nodes']} nodes x {f['ranks']} ranks, DDP, {unique / 2**20:.0f} MiB unique, every "
          f"link {f['link']}; load average {f['load']:.2f} -> {f['load_after']:.2f}")
    print(f"{'way':8} {'bucket served / unique':>23} {'restore s':>10} {'link-bound s':>13} {'fraction':>9}")
    for mode, m in f["modes"].items():
        print(f"{mode:8} {m['served_ratio']:23.3f} {m['seconds']:10.2f} {m['ideal_seconds']:13.2f} "
              f"{m['link_fraction']:9.2f}")


if __name__ == "__main__":
    sys.exit(main())
