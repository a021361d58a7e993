"""The peer tier's recovery and stall (docs/tiers.md), one run on one machine:

1. link: two network namespaces of this run's own joined by a veth pair capped at
   ``--link`` (``tc tbf``, 10gbit by default; benchmarks/netns.py), the partner's
   daemon (holding the lost node's replica in memory) in one and the recovering
   process in the other. Every repeat measures, in an order rotated each repeat:
   - floor: a plain pyzmq transfer of the share's bytes across the link (PUSH to
     PULL, 4 MiB frames) into memory allocated on the clock (fresh: each page is
     faulted in by the first byte written to it) and into memory touched before the
     clock starts (preallocated); the same with CurveZMQ on both sockets;
   - ckptd: ``ckptd.load(run, step, rank=0)`` of the lost node's share from the
     partner's memory (fresh memory), and ``load(..., out=preallocated)``, each with
     plaintext and with CurveZMQ under one key pair per node (docs/security.md, "The peer port"),
     every tensor compared bit-exact after the clock stops;
   and the CPU time both ends spend (receiving: this process's, and for ckptd its
   daemon's too, which lands the share; sending: the sender's or the partner daemon's),
   from which CurveZMQ's cost per GB follows. Each ckptd row ends once the daemon has
   the share's manifest down (off the clock): the next starts on a quiet disk;
2. bucket: the same ``ckptd.load`` from the object store (SeaweedFS on 127.0.0.1,
   nice 19, tests/seaweed.py) on an empty root;
3. disk: ``ckptd.load`` from the node's own disk, cold (page cache dropped where this
   process may: ``/proc/sys/vm/drop_caches``, else posix_fadvise DONTNEED on the files);
4. stall: ``producer.save``'s blocked time and time to durable (local commit) with
   replication off, on, and on at ``[peer] rate`` = ``--rate`` (capped), saves back to
   back (with it on, the previous step is being replicated meanwhile); with it on, time
   until the replica is held; and the bytes each daemon read from storage
   (/proc/PID/io ``read_bytes``) per byte it replicated.

    .venv/bin/python benchmarks/peer_bench.py [--gib 1] [--repeats 3] [--link 10gbit] [--rate 200MB] [--json out.json]

It runs as root (network namespaces): it makes the link, runs itself again inside
namespace ``b`` (everything but the partner daemons and the floor's senders, which run
in ``a``), and removes the link at the end, also on failure.

Goals: recovery from peer memory >= 0.9x the plain transfer's throughput into the
same kind of memory, in every repeat, plaintext and CurveZMQ, and >= 5x faster than
from the object store; stall with replication <= 1.05x without.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

import netns  # noqa: E402
import seaweed  # noqa: E402
from daemons import DaemonProcess, free_tcp_port  # noqa: E402

FRAME = 4 * 2**20
BUCKET = "bench"
RUN = "bench"
PORT = 7701  # in this run's own namespaces: no one else's port there

SENDER = r"""
import resource, sys, zmq
n, frame, ep, keys = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
data = bytearray(n)
for i in range(0, n, 4096): data[i] = i % 251
ctx = zmq.Context()
push = ctx.socket(zmq.PUSH)
if keys:  # CurveZMQ: the receiver's public key, then this sender's key pair
    push.curve_serverkey, push.curve_publickey, push.curve_secretkey = (k.encode() for k in keys)
push.setsockopt(zmq.SNDHWM, 8); push.connect(ep)
push.send(b"")  # ready: the clock starts when this arrives
ru = resource.getrusage(resource.RUSAGE_SELF); cpu = ru.ru_utime + ru.ru_stime
view = memoryview(data)
for off in range(0, n, frame):
    push.send(view[off:off + frame], copy=False)
push.close(linger=-1); ctx.term()
ru = resource.getrusage(resource.RUSAGE_SELF); print(ru.ru_utime + ru.ru_stime - cpu)
"""


def floor(link: netns.Link, nbytes: int, *, fresh: bool, curve: bool) -> dict[str, float]:
    """A plain pyzmq transfer of ``nbytes`` from namespace a into this process (in b):
    seconds, and CPU seconds of each end. ``fresh``: into memory allocated on the clock
    (torch.empty, as a load's tensors are), else into memory touched before it."""
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 8)
    pull.setsockopt(zmq.RCVTIMEO, 120_000)
    keys: list[str] = []
    if curve:
        server_public, server_secret = zmq.curve_keypair()
        pull.curve_server = True
        pull.curve_secretkey = server_secret
        keys = [k.decode() for k in (server_public, *zmq.curve_keypair())]
    port = pull.bind_to_random_port(f"tcp://{link.addr['b']}")
    child = subprocess.Popen([*link.wrap("a"), sys.executable, "-c", SENDER, str(nbytes), str(FRAME),
                              f"tcp://{link.addr['b']}:{port}", *keys], stdout=subprocess.PIPE, text=True)
    try:
        out: Any = None if fresh else _touched(nbytes)
        pull.recv()
        t0, c0 = time.perf_counter(), time.process_time()
        if fresh:
            out = memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy())  # type: ignore[arg-type]
        off = 0
        while off < nbytes:
            frame = pull.recv(copy=False)
            out[off:off + len(frame)] = frame.buffer
            off += len(frame)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        sent, _ = child.communicate(timeout=120)
        return {"s": seconds, "cpu_recv": cpu, "cpu_send": float(sent.strip() or "nan")}
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        pull.close(0)
        ctx.term()


def _touched(nbytes: int) -> memoryview:
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(1)  # every page faulted in before the clock
    return memoryview(t.numpy())  # type: ignore[arg-type]


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, every thread) of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def _sent(d: DaemonProcess) -> dict[str, int]:
    """The daemon's replication counts: bytes replicated, of them sent from staging, and
    read back from its files (the last two where the daemon counts them)."""
    out = subprocess.run([sys.executable, "-m", "ckptd", "status", "--json", "-c", str(d.config)],
                         capture_output=True, text=True, timeout=120, check=True)
    peer = json.loads(out.stdout)["peer"]
    return {k: int(peer[k]) for k in ("replicated_bytes", "staged_bytes", "file_bytes_read") if k in peer}


def _held(producer: Any, d: DaemonProcess, step: int) -> None:
    """Until ``step`` of ``producer``'s run, saved through ``d``, is in its partner's memory."""
    os.environ["CKPTD_CONFIG"] = str(d.config)  # the peer tier ``wait_complete`` asks: d's
    try:
        producer.wait_complete(step, timeout=600, tier="peer")
    finally:
        os.environ.pop("CKPTD_CONFIG")


def _io(d: DaemonProcess, before: tuple[int, dict[str, int]], replicating: bool) -> dict[str, int]:
    """What daemon ``d`` read from storage and replicated since ``before`` (``_read_bytes``, ``_sent``)."""
    sent = {n: v - before[1][n] for n, v in _sent(d).items()} if replicating else {}
    return {"read_bytes": _read_bytes(d.pid) - before[0], "replicated_bytes": 0, **sent, **_cached(d.root)}


def _touch(state: dict[str, torch.Tensor], step: int) -> None:
    """Change every tensor a little, as a training step does: a tensor unchanged since the
    previous step would be linked, not written again, and its file read back from the
    page cache by an earlier replication (docs/performance.md)."""
    for t in state.values():
        t[0] = float(step)


def measure_stall(work: Path, state: dict, repeats: int, rate: int, saves: float) -> dict[str, Any]:
    """Blocked time in save, save -> durable, and (replicating) save -> replica held,
    with replication off, on without a cap, and on at ``[peer] rate`` = ``rate``; and
    the bytes each daemon read from storage per byte it replicated (/proc/PID/io), its
    replication's own count of them and of the bytes it sent from staging. Staging
    holds ``saves`` checkpoints."""
    from ckptd import Producer

    out: dict[str, Any] = {"rate": rate, "staging_saves": saves}
    la, lc, lb = (f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(3))
    size = sum(t.nbytes for t in state.values())
    holder = _peer_daemon(work, "stall-holder", lb, [la, lc], memory=f"{4 * size + 2**28}")
    daemons = {"off": DaemonProcess(work, None, name="stall-off", keys={"nice": 0}),
               "on": _peer_daemon(work, "stall-on", la, [lb]),
               "capped": _peer_daemon(work, "stall-capped", lc, [lb], rate=rate)}
    daemons["off"].start()
    replicating = ("on", "capped")
    try:
        producers = {k: Producer(d.endpoint, f"stall-{k}", staging_size=int(saves * size) + 2**26) for k, d in daemons.items()}
        for p in producers.values():
            p.save(state, 0).wait(600)  # warm the arenas
        for k in replicating:
            _held(producers[k], daemons[k], 0)
        before = {k: (_read_bytes(d.pid), _sent(d) if k in replicating else {}) for k, d in daemons.items()}
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
        for k, d in daemons.items():
            out.setdefault("io", {})[k] = _io(d, before[k], k in replicating)
        for k in replicating:  # the backlog sent; then save -> replica held, alone
            _held(producers[k], daemons[k], step[k])
            alone = (_read_bytes(daemons[k].pid), _sent(daemons[k]))
            _touch(state, step[k] + 1)
            t0 = time.perf_counter()
            producers[k].save(state, step[k] + 1).wait(600)
            _held(producers[k], daemons[k], step[k] + 1)
            figures[k]["replica"].append(time.perf_counter() - t0)
            out["io"][f"{k} alone"] = _io(daemons[k], alone, True)
        for p in producers.values():
            p.close()
        for k, f in figures.items():
            out[k] = {name: statistics.median(v) for name, v in f.items() if v}
        return out
    finally:
        for d in (*daemons.values(), holder):
            d.close()


def _node_keys(folder: Path, endpoints: list[str]) -> tuple[dict[str, Path], Path]:
    """One key pair per node, as docs/security.md "The peer port" sets them up: each endpoint's
    secret key file, and the folder of every node's public key (``[peer] curve_peers``)."""
    from ckptd.peer.keys import key_name
    from ckptd.transport.curve import keygen

    peers = folder / "peers"
    peers.mkdir(parents=True)
    secrets = {}
    for ep in endpoints:
        public, secrets[ep] = keygen(key_name(ep), folder / "secret")
        shutil.copy(public, peers / public.name)
    return secrets, peers


def _link_daemon(work: Path, name: str, link: netns.Link, side: str, listen: str, peers: list[str],
                 curve: tuple[Path, Path] | None, tables: dict | None = None) -> DaemonProcess:
    """A daemon in namespace ``side``, nice 0 (the floor's priority), its peer port on
    the link: in plaintext (``allow_plaintext``), or with this node's own key pair."""
    peer: dict[str, Any] = {"listen": listen, "peers": peers, "memory": "3GiB", "stall": "30s"}
    keys: dict[str, Any] = {"nice": 0}
    if curve is None:
        peer["allow_plaintext"] = True
    else:
        keys["curve_secret_key"], peer["curve_peers"] = str(curve[0]), str(curve[1])
    d = DaemonProcess(work, None, name=name, keys=keys, tables={**(tables or {}), "peer": peer})
    d.wrap = link.wrap(side)
    d.start()
    return d


def measure_link(work: Path, state: dict[str, torch.Tensor], repeats: int, url: str,
                 link: netns.Link) -> dict[str, Any]:
    """The recovery rows across the link, and the bucket and cold-disk rows."""
    import ckptd
    from ckptd import Producer

    size = sum(t.nbytes for t in state.values())
    eps = {kind: {role: f"tcp://{link.addr[side]}:{PORT + i}" for role, side, i in
                  (("partner", "a", k), ("lost", "b", k), ("fresh", "b", k + 2))}
           for kind, k in (("plain", 0), ("curve", 1))}
    secrets, peers_dir = _node_keys(work / "keys", list(eps["curve"].values()))

    def keys(kind: str, role: str) -> tuple[Path, Path] | None:
        return (secrets[eps[kind][role]], peers_dir) if kind == "curve" else None

    daemons: dict[str, DaemonProcess] = {}
    res: dict[str, Any] = {"link": link.rate, "tensor_bytes": size}
    try:
        for kind in ("plain", "curve"):  # the lost nodes save, and replicate to their partners
            e = eps[kind]
            daemons[f"partner_{kind}"] = _link_daemon(work, f"partner-{kind}", link, "a", e["partner"], [e["lost"]],
                                                      keys(kind, "partner"))
            lost = daemons[f"lost_{kind}"] = _link_daemon(
                work, f"lost-{kind}", link, "b", e["lost"], [e["partner"]], keys(kind, "lost"),
                tables={"remote": {"url": url}} if kind == "plain" else None)
            os.environ["CKPTD_CONFIG"] = str(lost.config)
            p = Producer(lost.endpoint, RUN, staging_size=size + 2**26)
            p.save(state, 1).wait(600)
            p.wait_complete(1, timeout=900, tier="peer")
            if kind == "plain":
                p.wait_complete(1, timeout=900)  # in the bucket too
            p.close()
        lost = daemons["lost_plain"]
        files = sorted((lost.root / RUN / "step-000000000001").glob("r*.safetensors"))
        res["file_bytes"] = sum(f.stat().st_size for f in files)
        res["disk_cold"] = []
        for _ in range(repeats):  # its own disk, cold
            res["drop_caches"] = _drop_caches(files)
            t0 = time.perf_counter()
            ckptd.load(RUN, 1, root=lost.root, remote="")
            res["disk_cold"].append(time.perf_counter() - t0)
        for kind in ("plain", "curve"):  # the node is lost; a new one takes its place
            daemons.pop(f"lost_{kind}").close()
            e = eps[kind]
            daemons[f"fresh_{kind}"] = _link_daemon(work, f"fresh-{kind}", link, "b", e["fresh"], [e["partner"]],
                                                    keys(kind, "fresh"))
        bucket_config = work / "bucket.toml"  # no [peer]: the bucket row reads the bucket
        bucket_config.write_text(f'[remote]\nurl = "{url}"\n')
        preallocated = {k: torch.empty_like(v).fill_(0) for k, v in state.items()}

        def load(kind: str, out: dict[str, torch.Tensor] | None) -> Callable[[], dict[str, float]]:
            def row() -> dict[str, float]:
                fresh, partner = daemons[f"fresh_{kind}"], daemons[f"partner_{kind}"]
                shutil.rmtree(fresh.root / RUN, ignore_errors=True)
                os.environ["CKPTD_CONFIG"] = str(fresh.config)
                s0, r0 = _proc_cpu(partner.pid), _proc_cpu(fresh.pid)
                t0, c0 = time.perf_counter(), time.process_time()
                got = ckptd.load(RUN, 1, rank=0, out=out)
                figures = {"s": time.perf_counter() - t0, "cpu_send": _proc_cpu(partner.pid) - s0,
                           "cpu_recv": time.process_time() - c0 + _proc_cpu(fresh.pid) - r0}
                _same(state, got, f"ckptd.load from the partner ({kind}{', out=' if out else ''})")
                _landed(fresh.root)
                return figures
            return row

        def bucket(r: int) -> dict[str, float]:
            empty = work / f"empty-{r}"
            empty.mkdir()
            os.environ["CKPTD_CONFIG"] = str(bucket_config)
            t0 = time.perf_counter()
            ckptd.load(RUN, 1, root=empty, remote=url)
            return {"s": time.perf_counter() - t0}

        rows: dict[str, Callable[[], dict[str, float]]] = {}
        for kind in ("plain", "curve"):
            rows[f"floor_{kind}_fresh"] = lambda c=kind == "curve": floor(link, size, fresh=True, curve=c)
            rows[f"floor_{kind}_pre"] = lambda c=kind == "curve": floor(link, size, fresh=False, curve=c)
            rows[f"ckptd_{kind}_fresh"] = load(kind, None)
            rows[f"ckptd_{kind}_pre"] = load(kind, preallocated)
        names = list(rows)
        res["repeats"] = []
        for r in range(repeats):  # every row each repeat, in an order rotated by one each time
            order = names[r % len(names):] + names[:r % len(names)]
            figures = {name: rows[name]() for name in order}
            figures["bucket"] = bucket(r)
            figures["order"] = order  # type: ignore[assignment]
            res["repeats"].append(figures)
            report_repeat(r, figures, size)
    finally:
        os.environ.pop("CKPTD_CONFIG", None)
        for d in daemons.values():
            d.close()
    return res


def _landed(root: Path, timeout: float = 300.0) -> None:
    """Until the daemon's landing of the share in ``root`` is done (its manifest, written
    after the reader got its bytes): the next row starts on a quiet disk, and does not
    remove files the daemon is still writing."""
    manifest = root / RUN / "step-000000000001" / "manifest-r00000.json"
    deadline = time.monotonic() + timeout
    while not manifest.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{manifest} not written {timeout:g} s after the load returned")
        time.sleep(0.05)


def _same(want: dict[str, torch.Tensor], got: dict[str, Any], what: str) -> None:
    for name, t in want.items():
        if not torch.equal(got[name], t):
            raise RuntimeError(f"{what}: tensor {name!r} differs from what was saved")


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
    ap.add_argument("--link", default="10gbit", help="the link's rate cap, as tc writes it (10gbit, 1gbit)")
    ap.add_argument("--json")
    ap.add_argument("--only", choices=("recovery", "stall"), help="measure only these figures")
    ap.add_argument("--staging-saves", type=float, default=2.0,
                    help="staging holds this many checkpoints in the stall part (default 2)")
    ap.add_argument("--rate", default="200MB", help="[peer] rate of the stall's capped replication (default 200MB)")
    ap.add_argument("--in-netns", help=argparse.SUPPRESS)  # the link's tag: this is the run inside namespace b
    args = ap.parse_args()
    if args.only != "stall" and args.in_netns is None:
        return _across_link(args.link)
    nbytes = int(args.gib * 2**30)
    work = Path(tempfile.mkdtemp(prefix="peer-bench-"))
    server = seaweed.SeaweedS3(work / "s3", nice=19).start()
    os.environ.update(server.env())
    seaweed.make_bucket(server, BUCKET)
    try:
        torch.manual_seed(0)
        state = _state(nbytes, args.tensors)
        r: dict[str, Any] = {"bytes": nbytes, "repeats": args.repeats, "cpus": os.cpu_count()}
        if args.only != "stall":
            r["recovery"] = measure_link(work, state, args.repeats, f"s3://{BUCKET}/peer",
                                         netns.Link(args.link, tag=args.in_netns))
        if args.only != "recovery":
            from ckptd.config import parse_size

            r["stall"] = measure_stall(work, state, args.repeats, parse_size(args.rate), args.staging_saves)
    finally:
        server.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    report(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


def _across_link(rate: str) -> int:
    """Make the link, run this benchmark again inside namespace b, remove the link."""
    if os.geteuid() != 0:
        raise SystemExit("peer_bench.py: the recovery rows run across network namespaces this benchmark makes, "
                         "which needs root: run it as root, or with --only stall")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run removes its link too
    link = netns.Link(rate)
    try:
        link.up()
        return subprocess.run([*link.wrap("b"), sys.executable, *sys.argv, "--in-netns", link.tag]).returncode
    finally:
        link.down()


def report(r: dict[str, Any]) -> None:
    print(f"share: {r['bytes'] / 2**30:.2f} GiB of tensors, {r['repeats']} repeats; one shared machine of "
          f"{r['cpus']} cores")
    if "recovery" in r:
        report_recovery(r["recovery"])
    if "stall" in r:
        report_stall(r["stall"], r["repeats"])


ROWS = [(f"{kind}_{mem}", kind, mem) for kind in ("plain", "curve") for mem in ("fresh", "pre")]


def report_repeat(i: int, f: dict[str, Any], nbytes: int) -> None:
    gb = nbytes / 1e9
    print(f"repeat {i + 1} (order: {', '.join(f['order'])}):", flush=True)
    for key, kind, mem in ROWS:
        fl, ck = f[f"floor_{key}"], f[f"ckptd_{key}"]
        print(f"  {kind:<5} {mem:<5} floor {fl['s']:6.2f} s {gb / fl['s']:5.2f} GB/s "
              f"({(fl['cpu_recv'] + fl['cpu_send']) / gb:4.2f} CPU-s/GB)   ckptd {ck['s']:6.2f} s "
              f"{gb / ck['s']:5.2f} GB/s ({(ck['cpu_recv'] + ck['cpu_send']) / gb:4.2f} CPU-s/GB)   "
              f"{fl['s'] / ck['s']:.2f}x", flush=True)


def report_recovery(r: dict[str, Any]) -> None:
    gb = r["tensor_bytes"] / 1e9
    reps = r["repeats"]
    print(f"recovery across a veth pair capped at {r['link']} (tc tbf) between two network namespaces; "
          f"{r['file_bytes'] / 2**30:.2f} GiB of files")
    for i, f in enumerate(reps):
        report_repeat(i, f, r["tensor_bytes"])
    for key, kind, mem in ROWS:
        ratios = [f[f"floor_{key}"]["s"] / f[f"ckptd_{key}"]["s"] for f in reps]
        print(f"ckptd.load {kind} into {mem} memory / floor: {', '.join(f'{q:.2f}' for q in ratios)} "
              f"(goal >= 0.9 in every repeat: {'met' if min(ratios) >= 0.9 else 'missed'})")
    for who in ("floor", "ckptd"):  # what CurveZMQ costs: CPU seconds per GB moved, both ends
        cost = {end: statistics.median((f[f"{who}_curve_pre"][end] - f[f"{who}_plain_pre"][end]) / gb for f in reps)
                for end in ("cpu_send", "cpu_recv")}
        speed = statistics.median(gb / f[f"{who}_curve_pre"]["s"] for f in reps)
        print(f"CurveZMQ ({who}): +{cost['cpu_send']:.2f} CPU-s/GB sending, +{cost['cpu_recv']:.2f} receiving "
              f"(against plaintext), {speed:.2f} GB/s reached; a 10 Gbit/s link (1.25 GB/s) would need "
              f"{1.25 * cost['cpu_send']:.1f} + {1.25 * cost['cpu_recv']:.1f} more cores, 100 Gbit/s "
              f"{12.5 * cost['cpu_send']:.1f} + {12.5 * cost['cpu_recv']:.1f}")
    bucket = statistics.median(f["bucket"]["s"] for f in reps)
    peer = statistics.median(f["ckptd_plain_fresh"]["s"] for f in reps)
    print(f"object store (SeaweedFS on loopback): ckptd.load {bucket:.2f} s, {gb / bucket:.2f} GB/s; peer memory "
          f"{bucket / peer:.1f}x faster (goal >= 5)")
    cold = statistics.median(r["disk_cold"])
    print(f"own disk, cold ({r['drop_caches']}): ckptd.load {cold:.2f} s, {gb / cold:.2f} GB/s")


def report_stall(s: dict[str, Any], repeats: int) -> None:
    print(f"stall: {2 * repeats} saves back to back each, replication off, on, and on at [peer] rate = "
          f"{s['rate'] / 1e6:.0f} MB/s (capped), in blocks off, on, capped, capped, on, off; staging holds "
          f"{s.get('staging_saves', 1):g} checkpoint(s)")
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
        if "staged_bytes" in io and io["replicated_bytes"]:
            print(f"  {'':<10} of the bytes replicated: {io['staged_bytes'] / io['replicated_bytes']:.0%} sent from "
                  f"staging, {io['file_bytes_read'] / io['replicated_bytes']:.0%} read back from the files")
    for k in ("on alone", "capped alone"):
        io = s["io"].get(k)
        if io and io["replicated_bytes"]:
            print(f"  {k}: one save, replicated before the next: read/replicated "
                  f"{io['read_bytes'] / io['replicated_bytes']:.3f}, "
                  f"{io.get('staged_bytes', 0) / io['replicated_bytes']:.0%} sent from staging")
    print("  goal: blocked <= 1.05x off; read/replicated: bytes read from storage per byte replicated;\n"
          "  cached: the share files' bytes in the page cache at the end (fincore)")


if __name__ == "__main__":
    sys.exit(main())
