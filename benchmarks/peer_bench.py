"""The peer tier's recovery and stall (docs/tiers.md), one run on one machine:

1. floor: a plain pyzmq transfer of the share's bytes between two processes (PUSH
   to PULL, 4 MiB frames, into memory zero-filled before the clock starts), and the
   same into memory allocated on the clock, as a load's tensors are (on a VM a page's
   first write can cost as much as moving its bytes); each repeat measures every
   row, and the ratios are given per repeat (the machine is shared and noisy);
2. peer: a fresh node (empty root, new daemon) gets a lost node's share back with
   ``ckptd.load`` from the partner's memory: the fetch and check of the whole files
   alone, and ``ckptd.load`` (list the peers, read each tensor into its own memory,
   check it);
3. bucket: the same ``ckptd.load`` from the object store (SeaweedFS on 127.0.0.1,
   nice 19, tests/seaweed.py) on an empty root;
4. disk: ``ckptd.load`` from the node's own disk, cold (page cache dropped where this
   process may: ``/proc/sys/vm/drop_caches``, else posix_fadvise DONTNEED on the files);
5. stall: ``producer.save``'s blocked time and time to durable (local commit) with
   replication off, on, and on at ``[peer] rate`` = ``--rate`` (capped), saves back to
   back (with it on, the previous step is being replicated meanwhile); with it on, time
   until the replica is held; and the bytes each daemon read from storage
   (/proc/PID/io ``read_bytes``) per byte it replicated.

    .venv/bin/python benchmarks/peer_bench.py [--gib 1] [--repeats 3] [--rate 200MB] [--json out.json]

Goals: recovery from peer memory >= 0.9x the plain transfer's throughput and >= 5x
faster than from the object store; stall with replication <= 1.05x without.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

import seaweed  # noqa: E402
from daemons import DaemonProcess, free_tcp_port  # noqa: E402

FRAME = 4 * 2**20
BUCKET = "bench"

SENDER = r"""
import sys, zmq
n, frame, ep = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
data = bytearray(n)
for i in range(0, n, 4096): data[i] = i % 251
ctx = zmq.Context()
push = ctx.socket(zmq.PUSH)
push.setsockopt(zmq.SNDHWM, 8); push.connect(ep)
push.send(b"")  # ready: the clock starts when this arrives
view = memoryview(data)
for off in range(0, n, frame):
    push.send(view[off:off + frame], copy=False)
push.close(linger=-1); ctx.term()
"""


def plain_transfer(nbytes: int, fresh: bool = False) -> float:
    """Seconds for ``nbytes`` from another process into this one's memory over pyzmq:
    memory zero-filled before the clock starts (its pages already faulted in), or with
    ``fresh``, allocated on the clock as ``ckptd.load`` must (torch.empty: each page is
    faulted in by the first byte written to it)."""
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 8)
    pull.setsockopt(zmq.RCVTIMEO, 120_000)
    ep = f"tcp://127.0.0.1:{free_tcp_port()}"
    pull.bind(ep)
    child = subprocess.Popen([sys.executable, "-c", SENDER, str(nbytes), str(FRAME), ep])
    try:
        out: Any = None if fresh else bytearray(nbytes)
        pull.recv()
        t0 = time.perf_counter()
        if fresh:
            out = memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy())
        off = 0
        while off < nbytes:
            frame = pull.recv(copy=False)
            out[off:off + len(frame)] = frame.buffer
            off += len(frame)
        return time.perf_counter() - t0
    finally:
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        pull.close(0)
        ctx.term()


def _state(nbytes: int, tensors: int) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.randn(nbytes // tensors // 4) for i in range(tensors)}


def _peer_daemon(work: Path, name: str, listen: str, peers: list[str], memory: str = "3GiB",
                 tables: dict | None = None, **peer: Any) -> DaemonProcess:
    # nice 0, the plain transfer's priority (the config's default, 19, yields to the trainer)
    d = DaemonProcess(work, None, name=name, keys={"nice": 0}, tables={**(tables or {}),
                      "peer": {"listen": listen, "peers": peers, "memory": memory, "stall": "30s", **peer}})
    d.start()
    return d


def _read_bytes(pid: int) -> int:
    """Bytes the process ``pid`` made the kernel fetch from storage (page cache hits and
    O_DIRECT alike count as they reach the device), from /proc/PID/io."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/io has no read_bytes")


def _cached(root: Path) -> dict[str, int]:
    """The data files under ``root``: their bytes, and how many of them are in the page
    cache (util-linux ``fincore``; none where it is missing)."""
    files = [str(f) for f in root.rglob("*.safetensors")]
    try:
        res = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
                             capture_output=True, text=True, timeout=120, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {"file_bytes": sum(os.path.getsize(f) for f in files), "cached_bytes": sum(map(int, res))}


def _replicated_bytes(d: DaemonProcess) -> int:
    out = subprocess.run([sys.executable, "-m", "ckptd", "status", "--json", "-c", str(d.config)],
                         capture_output=True, text=True, timeout=120, check=True)
    return int(json.loads(out.stdout)["peer"]["replicated_bytes"])


def _held(producer: Any, d: DaemonProcess, step: int) -> None:
    """Until ``step`` of ``producer``'s run, saved through ``d``, is in its partner's memory."""
    os.environ["CKPTD_CONFIG"] = str(d.config)  # the peer tier ``wait_complete`` asks: d's
    try:
        producer.wait_complete(step, timeout=600, tier="peer")
    finally:
        os.environ.pop("CKPTD_CONFIG")


def _touch(state: dict[str, torch.Tensor], step: int) -> None:
    """Change every tensor a little, as a training step does: a tensor unchanged since the
    previous step would be linked, not written again, and its file read back from the
    page cache by an earlier replication (docs/performance.md)."""
    for t in state.values():
        t[0] = float(step)


def measure_stall(work: Path, state: dict, repeats: int, rate: int) -> dict[str, Any]:
    """Blocked time in save, save -> durable, and (replicating) save -> replica held,
    with replication off, on without a cap, and on at ``[peer] rate`` = ``rate``; and
    the bytes each daemon read from storage per byte it replicated (/proc/PID/io)."""
    from ckptd import Producer

    out: dict[str, Any] = {"rate": rate}
    la, lc, lb = (f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(3))
    size = sum(t.nbytes for t in state.values())
    holder = _peer_daemon(work, "stall-holder", lb, [la, lc], memory=f"{4 * size + 2**28}")
    daemons = {"off": DaemonProcess(work, None, name="stall-off", keys={"nice": 0}),
               "on": _peer_daemon(work, "stall-on", la, [lb]),
               "capped": _peer_daemon(work, "stall-capped", lc, [lb], rate=rate)}
    daemons["off"].start()
    replicating = ("on", "capped")
    try:
        producers = {k: Producer(d.endpoint, f"stall-{k}", staging_size=size + 2**26) for k, d in daemons.items()}
        for p in producers.values():
            p.save(state, 0).wait(600)  # warm the arenas
        for k in replicating:
            _held(producers[k], daemons[k], 0)
        before = {k: (_read_bytes(d.pid), _replicated_bytes(d) if k in replicating else 0)
                  for k, d in daemons.items()}
        figures: dict[str, dict[str, list[float]]] = {k: {"blocked": [], "durable": [], "replica": []}
                                                       for k in daemons}
        step = {k: 0 for k in daemons}
        # blocks of back-to-back saves (the next right after the last is durable, so that
        # with replication on the previous step is being sent meanwhile), in the order
        # off, on, capped, capped, on, off: drift on the shared machine falls on all alike;
        # each block starts once the others' replication is done
        for k in ("off", "on", "capped", "capped", "on", "off"):
            for r in replicating:
                if step[r]:
                    _held(producers[r], daemons[r], step[r])
            for _ in range(repeats):
                step[k] += 1
                _touch(state, step[k])
                t0 = time.perf_counter()
                h = producers[k].save(state, step[k])
                figures[k]["blocked"].append(time.perf_counter() - t0)
                h.wait(600)
                figures[k]["durable"].append(time.perf_counter() - t0)
        for k in replicating:  # the backlog sent; then save -> replica held, alone
            _held(producers[k], daemons[k], step[k])
            _touch(state, step[k] + 1)
            t0 = time.perf_counter()
            producers[k].save(state, step[k] + 1).wait(600)
            _held(producers[k], daemons[k], step[k] + 1)
            figures[k]["replica"].append(time.perf_counter() - t0)
        for k, d in daemons.items():
            read = _read_bytes(d.pid) - before[k][0]
            sent = (_replicated_bytes(d) - before[k][1]) if k in replicating else 0
            out.setdefault("io", {})[k] = {"read_bytes": read, "replicated_bytes": sent, **_cached(d.root)}
        for p in producers.values():
            p.close()
        for k, f in figures.items():
            out[k] = {name: statistics.median(v) for name, v in f.items() if v}
        return out
    finally:
        for d in (*daemons.values(), holder):
            d.close()


def measure_recovery(work: Path, state: dict, repeats: int, url: str) -> dict[str, Any]:
    import ckptd
    from ckptd.config import load as load_config
    from ckptd.tiers.peer_reader import PeerTier

    la, lb, lc = (f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(3))
    lost = _peer_daemon(work, "lost", la, [lb], tables={"remote": {"url": url}})
    partner = _peer_daemon(work, "partner", lb, [la, lc])
    size = sum(t.nbytes for t in state.values())
    res: dict[str, Any] = {}
    try:
        os.environ["CKPTD_CONFIG"] = str(lost.config)
        from ckptd import Producer

        p = Producer(lost.endpoint, "bench", staging_size=size + 2**26)
        p.save(state, 1).wait(600)
        p.wait_complete(1, timeout=900, tier="peer")
        p.wait_complete(1, timeout=900)  # in the bucket too
        p.close()
        files = sorted((lost.root / "bench" / "step-000000000001").glob("r*.safetensors"))
        res["file_bytes"] = sum(f.stat().st_size for f in files)

        # its own disk, cold
        res["disk_cold"] = []
        for _ in range(repeats):
            res["drop_caches"] = _drop_caches(files)
            t0 = time.perf_counter()
            ckptd.load("bench", 1, root=lost.root, remote="")
            res["disk_cold"].append(time.perf_counter() - t0)
        lost.close()

        fresh = _peer_daemon(work, "fresh", lc, [lb])  # the new node: empty root, its daemon started
        os.environ["CKPTD_CONFIG"] = str(fresh.config)
        try:
            tier = PeerTier(load_config(fresh.config))
            held = tier.holdings("bench")
            (endpoint, where, m), = held[(1, 0)]
            sizes = dict(m.files)
            for k in ("plain_transfer", "plain_fresh", "peer_fetch", "peer_load", "bucket_load"):
                res[k] = []
            for r in range(repeats):  # each repeat measures every row: ratios within one repeat
                res["plain_transfer"].append(plain_transfer(size))
                res["plain_fresh"].append(plain_transfer(size, fresh=True))
                t0 = time.perf_counter()
                data = tier.read_files(endpoint, m, sizes)  # every tensor and header checked
                res["peer_fetch"].append(time.perf_counter() - t0)
                del data
                shutil.rmtree(fresh.root / "bench", ignore_errors=True)
                t0 = time.perf_counter()
                ckptd.load("bench", 1, rank=0)  # from the partner's memory into this process's
                res["peer_load"].append(time.perf_counter() - t0)
                shutil.rmtree(fresh.root / "bench", ignore_errors=True)
                empty = work / f"empty-{r}"
                empty.mkdir()
                t0 = time.perf_counter()
                ckptd.load("bench", 1, root=empty, remote=url)
                res["bucket_load"].append(time.perf_counter() - t0)
        finally:
            fresh.close()
    finally:
        os.environ.pop("CKPTD_CONFIG", None)
        lost.close()
        partner.close()
    res["ratios"] = [{"fetch": res["plain_transfer"][i] / res["peer_fetch"][i],
                      "load": res["plain_transfer"][i] / res["peer_load"][i],
                      "load_fresh": res["plain_fresh"][i] / res["peer_load"][i],
                      "bucket": res["bucket_load"][i] / res["peer_load"][i]} for i in range(repeats)]
    return {k: statistics.median(v) if isinstance(v, list) and k != "ratios" else v for k, v in res.items()}


def _drop_caches(files: list[Path]) -> str:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "posix_fadvise DONTNEED (drop_caches not permitted)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--only", choices=("recovery", "stall"), help="measure only these figures")
    ap.add_argument("--rate", default="200MB", help="[peer] rate of the stall's capped replication (default 200MB)")
    args = ap.parse_args()
    nbytes = int(args.gib * 2**30)
    work = Path(tempfile.mkdtemp(prefix="peer-bench-"))
    server = seaweed.SeaweedS3(work / "s3", nice=19).start()
    os.environ.update(server.env())
    seaweed.make_bucket(server, BUCKET)
    try:
        state = _state(nbytes, args.tensors)
        r: dict[str, Any] = {"bytes": nbytes, "repeats": args.repeats}
        if args.only != "stall":
            r.update(measure_recovery(work, state, args.repeats, f"s3://{BUCKET}/peer"))
        if args.only != "recovery":
            from ckptd.config import parse_size

            r["stall"] = measure_stall(work, state, args.repeats, parse_size(args.rate))
    finally:
        server.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    report(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


def report(r: dict[str, Any]) -> None:
    gb = r["bytes"] / 1e9
    print(f"share: {r['bytes'] / 2**30:.2f} GiB of tensors; medians of {r['repeats']}; one noisy shared machine")
    if "peer_load" in r:
        report_recovery(r, gb)
    if "stall" in r:
        report_stall(r["stall"], r["repeats"])


def report_recovery(r: dict[str, Any], gb: float) -> None:
    print(f"recovery ({r['file_bytes'] / 2**30:.2f} GiB of files):")
    rows = [("plain pyzmq transfer (floor)", r["plain_transfer"]),
            ("plain pyzmq transfer into fresh memory", r["plain_fresh"]),
            ("peer memory: fetch + check", r["peer_fetch"]),
            ("peer memory: ckptd.load(rank=0) into memory", r["peer_load"]),
            ("object store: ckptd.load", r["bucket_load"]), (f"own disk, cold ({r['drop_caches']})", r["disk_cold"])]
    for name, s in rows:
        print(f"  {name:<62} {s:7.2f} s  {gb / s:6.2f} GB/s")
    for i, q in enumerate(r["ratios"]):
        print(f"  repeat {i + 1}: peer fetch {q['fetch']:.2f}x and load {q['load']:.2f}x the plain transfer's "
              f"throughput ({q['load_fresh']:.2f}x into fresh memory); load {q['bucket']:.1f}x the object store's")
    print(f"peer fetch vs plain transfer throughput: {r['plain_transfer'] / r['peer_fetch']:.2f}x (goal >= 0.9)")
    print(f"peer load vs plain transfer throughput:  {r['plain_transfer'] / r['peer_load']:.2f}x "
          f"({r['plain_fresh'] / r['peer_load']:.2f}x against the transfer into fresh memory)")
    print(f"peer load vs object store: {r['bucket_load'] / r['peer_load']:.1f}x faster (goal >= 5)")


def report_stall(s: dict[str, Any], repeats: int) -> None:
    print(f"stall: {2 * repeats} saves back to back each, replication off, on, and on at [peer] rate = "
          f"{s['rate'] / 1e6:.0f} MB/s (capped), in blocks off, on, capped, capped, on, off")
    off = s["off"]
    print(f"  {'':<10} {'blocked ms':>11} {'x off':>6} {'durable s':>10} {'x off':>6} {'replica held s':>15} "
          f"{'read/replicated':>16} {'cached':>9}")
    for k in ("off", "on", "capped"):
        f, io = s[k], s["io"][k]
        held = f"{f['replica']:.2f}" if "replica" in f else "-"
        ratio = f"{io['read_bytes'] / io['replicated_bytes']:.2f}" if io["replicated_bytes"] else \
            f"{io['read_bytes'] / 2**20:.0f} MiB read"
        cached = f"{io['cached_bytes'] / io['file_bytes']:.0%}" if io.get("file_bytes") else "-"
        print(f"  {k:<10} {f['blocked'] * 1e3:>11.0f} {f['blocked'] / off['blocked']:>6.2f} {f['durable']:>10.2f} "
              f"{f['durable'] / off['durable']:>6.2f} {held:>15} {ratio:>16} {cached:>9}")
    print("  goal: blocked <= 1.05x off; read/replicated: bytes read from storage per byte replicated;\n"
          "  cached: the share files' bytes in the page cache at the end (fincore)")


if __name__ == "__main__":
    sys.exit(main())
