#!/usr/bin/env python3
"""ckptd's performance report: ckptd against its floors and its competitors, in one run
on the same bytes, judged against the goals in benchmarks/README.md.

    python benchmarks/bench.py --json report.json           # 1 GiB in 64 float32 tensors
    python benchmarks/bench.py --size 64MiB --tensors 16 --repeat 1

Measured, each as a saver process of its own (benchmarks/workers.py) that maps
the one shared payload (benchmarks/payload.py):

* floors: memcpy into a preallocated buffer; a raw sequential write + fsync,
  through the page cache and with O_DIRECT;
* the usual savers: torch.save, safetensors' save_file, naive h5py (each + fsync);
  DCP async_save with its thread and its process executor;
* ckptd: a real ``ckptd serve`` per transport (shm, inline over ipc, inline over
  tcp with CurveZMQ) and format (chunk, hdf5), through ``emit`` and ``save``.

For each: how long the caller was blocked, how long until durable, GB/s, the
peak RSS of the saver and of its writer process (ckptd's daemon, DCP's writer).
Every measurement runs once per repeat, interleaved (the raw writes first, then
every ckptd variant in an order that rotates, then the other savers), so slow
phases of a shared machine hit all of them; a warm-up round runs first and is
not reported. benchmarks/README.md says how to read every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptd.config import parse_size  # also fails early, before any process starts, without ckptd

import report
from baselines import CopyTargets, raw_write_fsync, time_call
from daemons import ENV_ISOLATE, CurveSetup, DaemonProcess, PySpy, free_tcp_port, isolated_env, tcp_setup
from payload import SharedPayload, make_state, state_bytes
from procmem import MiB, Watch, mapped_memfds
from workers import CkptdRun, Worker, WorkerError, ckptd_emit, ckptd_save

# benchmarks/hdf5_bench.py builds on these (``import bench``): keep them importable from here
__all__ = ["GB", "_ENV_ISOLATE", "CkptdRun", "CopyTargets", "DaemonProcess", "check_disk", "ckptd_emit",
           "ckptd_save", "main", "make_state", "raw_write_fsync", "state_bytes", "time_call"]

GB = report.GB
_ENV_ISOLATE = ENV_ISOLATE  # the name hdf5_bench.py uses
TRANSPORTS = ("shm", "inline", "tcp")
FORMATS = ("chunk", "hdf5")
APIS = ("emit", "save")
STAGING_MEMFD = "ckptd-staging"  # the name ckptd gives its arena's memfd: mapped by the daemon = shm in use


# -- what runs --------------------------------------------------------------------------------------
@dataclass
class Variant:
    """One ckptd configuration: its daemon and its producer process."""

    transport: str
    format: str
    daemon: DaemonProcess
    producer_options: dict[str, Any] = field(default_factory=dict)  # CurveZMQ keys for tcp
    worker: Worker | None = None
    step: int = 0

    @property
    def name(self) -> str:
        return f"{self.transport}-{self.format}"

    @property
    def run_id(self) -> str:
        return f"bench-{self.name}"


@dataclass
class Dcp:
    key: str  # "dcp.thread", "dcp.thread_reused", "dcp.process"
    worker: Worker
    writer_pid: int | None = None  # the process executor's writer, known after its first save


@dataclass
class Lab:
    """Everything ``run`` started, so that teardown stops exactly that, in a safe order."""

    base: Path
    payload: SharedPayload | None = None
    baseline: Worker | None = None
    dcps: list[Dcp] = field(default_factory=list)
    variants: list[Variant] = field(default_factory=list)
    spy: PySpy | None = None
    notes: list[str] = field(default_factory=list)

    def teardown(self) -> None:
        """Workers first: a producer says bye and its last commit completes while its daemon
        still runs (a worker that does not quit in time is killed). Then the daemons
        (SIGTERM: drain, exit), then the payload."""
        workers = [w for w in [self.baseline, *(d.worker for d in self.dcps), *(v.worker for v in self.variants)]
                   if w is not None]
        for w in workers:
            with contextlib.suppress(Exception):
                w.close()
        for v in self.variants:
            v.daemon.close()
        if self.spy is not None:
            self.spy.wait()
        if self.payload is not None:
            self.payload.close()


# -- measuring ------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace, lab: Lab) -> None:
        self.args = args
        self.lab = lab
        self.records: dict[str, list[dict[str, Any]]] = {}
        self.round = 0
        self.direct_refused = False  # the filesystem refused O_DIRECT once: it will not change its mind
        self.call_timeout = args.timeout + 60

    @property
    def baseline(self) -> Worker:
        assert self.lab.baseline is not None
        return self.lab.baseline

    def measure(self, key: str, worker: Worker, op: str, record: bool, daemon_pid: int | None = None,
                **call: Any) -> dict[str, Any]:
        """One measurement in ``worker``, with the peak memory of it and of its writer process."""
        pids = {"producer": worker.pid} | ({"daemon": daemon_pid} if daemon_pid else {})
        with Watch(pids) as watch:
            answer = worker.call(op, self.call_timeout, **call)
        if "refused" in answer:
            return answer
        if record:
            rec: dict[str, Any] = {"round": self.round, "blocked_s": answer.get("blocked_s"),
                                   "durable_s": answer.get("durable_s")}
            for role, peak in watch.peaks.items():
                rec[role] = peak.to_dict()
                rec[f"{role}_cpu_s"] = watch.cpu_s[role]
            if "daemon" in watch.faults:
                rec["daemon_faults"] = watch.faults["daemon"]
            if "staging_wait_s" in answer:
                rec["staging_wait_s"] = answer["staging_wait_s"]
            self.records.setdefault(key, []).append(rec)
        return answer

    def one_round(self, record: bool) -> None:
        if record:
            self.records.setdefault("_loadavg", []).append({"round": self.round, "loadavg_1min": os.getloadavg()[0]})
        self.memcpy(record)
        self.raw_writes(record)
        self.ckptd_variants(record)
        self.savers(record)
        self.dcp(record)
        self.round += 1

    def memcpy(self, record: bool) -> None:
        answer = self.measure("memcpy", self.baseline, "memcpy", record)
        if record:
            ways = answer["ways"]
            rec = self.records["memcpy"][-1]
            rec["blocked_s"] = min(ways.values())
            rec["durable_s"] = None
            for way, seconds in ways.items():  # the three ways, for the JSON
                self.records.setdefault(f"memcpy.{way}", []).append({"round": self.round, "blocked_s": seconds})

    def raw_writes(self, record: bool) -> None:
        for key, op in (("raw.buffered", "raw_buffered"), ("raw.direct", "raw_direct")):
            if key == "raw.direct" and self.direct_refused:
                continue
            os.sync()  # no measurement pays for the previous one's writeback or deletes
            answer = self.measure(key, self.baseline, op, record, path=str(self.lab.base / "raw.bin"))
            if "refused" in answer:
                self.direct_refused = True
                self.lab.notes.append(f"raw O_DIRECT: {answer['refused']}; only the buffered raw write was "
                                      "measured (tmpfs and some network filesystems refuse O_DIRECT)")

    def ckptd_variants(self, record: bool) -> None:
        """Every variant, in an order that rotates by one each round (so that no variant always
        runs right after the raw writes, or right after another), each call in turn."""
        variants = [(v, v.worker) for v in self.lab.variants if v.worker is not None]
        if not variants:
            return
        shift = self.round % len(variants)
        apis = list(self.args.api) if self.round % 2 == 0 else list(reversed(self.args.api))
        for v, worker in variants[shift:] + variants[:shift]:
            for api in apis:
                os.sync()
                v.step += 1
                key = report.ckptd_key(v.transport, v.format, api)
                self.measure(key, worker, api, record, daemon_pid=v.daemon.pid, step=v.step)
                if record:
                    self.records[key][-1]["step"] = v.step
                # keep the disk footprint at one checkpoint: the report needs the bytes written, not kept
                shutil.rmtree(v.daemon.root / v.run_id / f"step-{v.step:012d}", ignore_errors=True)

    def savers(self, record: bool) -> None:
        for key, op, name in (("torch_save", "torch_save", "baseline.pt"),
                              ("safetensors", "safetensors", "baseline.safetensors"),
                              ("h5py", "h5py", "baseline.h5")):
            os.sync()
            self.measure(key, self.baseline, op, record, path=str(self.lab.base / name))

    def dcp(self, record: bool) -> None:
        for d in list(self.lab.dcps):
            os.sync()
            try:
                answer = self.measure(d.key, d.worker, "save", record, daemon_pid=d.writer_pid)
            except WorkerError as exc:  # a baseline that cannot run here is a note, not a failure
                self.lab.notes.append(f"{d.key} failed, left out: {str(exc).splitlines()[-1]}")
                self.lab.dcps.remove(d)
                d.worker.close()
                continue
            if answer.get("writer_pid"):
                d.writer_pid = answer["writer_pid"]

    def add_daemon_figures(self) -> None:
        """The daemons' own commit times (first byte received -> manifest durable), from their logs."""
        for v in self.lab.variants:
            secs = v.daemon.commit_seconds()
            for api in APIS:
                for rec in self.records.get(report.ckptd_key(v.transport, v.format, api), []):
                    rec["daemon_commit_s"] = secs.get((v.run_id, rec.get("step", -1)))


# -- setting up ------------------------------------------------------------------------------------------
def start_lab(args: argparse.Namespace, lab: Lab) -> None:
    """The payload, the daemons, then every worker; all started before any is waited for, so
    that the imports of a dozen processes overlap."""
    payload = lab.payload = SharedPayload.create(args.size_bytes, args.tensors)
    env = isolated_env()
    setup = {"fd": payload.fd, "layout": payload.layout.to_dict(), "block": args.block, "timeout": args.timeout}
    logs = lab.base / "logs"
    logs.mkdir()

    def worker(name: str, **role: Any) -> Worker:
        return Worker(name, setup | role, logs / f"{name}.log", env, pass_fds=(payload.fd,))

    start_daemons(args, lab)
    lab.baseline = worker("baseline", role="baseline")
    if not args.no_dcp:
        for key, executor, reuse in (("dcp.thread", "thread", False), ("dcp.thread_reused", "thread", True),
                                     ("dcp.process", "process", False)):
            folder = lab.base / key
            folder.mkdir()
            lab.dcps.append(Dcp(key, worker(key, role="dcp", dir=str(folder), executor=executor,
                                            reuse_stager=reuse)))
    for v in lab.variants:
        try:
            v.daemon.wait_ready()
        except RuntimeError as exc:  # one variant that cannot run is a note; the report goes on
            lab.notes.append(f"ckptd {v.name}: the daemon could not start, left out: {str(exc).splitlines()[-1]}")
            continue
        options = {"staging_size": args.staging_bytes, "timeout": 30,
                   "transport": "shm" if v.transport == "shm" else "inline"} | v.producer_options
        v.worker = worker(f"ckptd-{v.name}", role="ckptd", endpoint=v.daemon.endpoint, run=v.run_id,
                          format=v.format, options=options)
    lab.baseline.wait_ready(args.timeout + 120)
    for d in list(lab.dcps):
        try:
            d.worker.wait_ready(args.timeout + 120)
        except WorkerError as exc:
            lab.notes.append(f"{d.key} could not start, left out: {str(exc).splitlines()[-1]}")
            lab.dcps.remove(d)
            d.worker.close()
    for v in lab.variants:
        if v.worker is None:
            continue
        try:
            v.worker.wait_ready(args.timeout + 120)
        except WorkerError as exc:
            lab.notes.append(f"ckptd {v.name}: the producer could not start, left out: {str(exc).splitlines()[-1]}")
            v.worker.close()
            v.worker = None


def start_daemons(args: argparse.Namespace, lab: Lab) -> None:
    """One daemon per variant; tcp ones with CurveZMQ keys, or a note saying why not."""
    transports = list(args.transports)
    curve = CurveSetup({}, {})  # ipc:// needs no keys
    if "tcp" in transports:
        try:
            curve = tcp_setup(lab.base / "curve")
        except RuntimeError as exc:
            lab.notes.append(f"tcp: not available ({exc})")
            transports.remove("tcp")
    keys = dict(args.daemon_set)
    if args.memory_budget:
        keys["memory_budget"] = args.memory_budget
    for transport in transports:
        for fmt in args.formats:
            endpoint = f"tcp://127.0.0.1:{free_tcp_port()}" if transport == "tcp" else None
            tcp = transport == "tcp"
            daemon = DaemonProcess(lab.base, args.chunk_size, name=f"daemon-{transport}-{fmt}", endpoint=endpoint,
                                   keys=keys | (curve.daemon_keys if tcp else {}),
                                   nice=args.daemon_nice, extra_env=args.daemon_env)
            lab.variants.append(Variant(transport, fmt, daemon, curve.producer_options if tcp else {}))
            daemon.start(wait=False)


def check_shm(lab: Lab) -> None:
    """Whether each daemon maps its producer's staging arena: the mark of the shm transport."""
    for v in lab.variants:
        if v.worker is None:
            continue
        maps = STAGING_MEMFD in mapped_memfds(v.daemon.pid)
        if v.transport == "shm" and not maps:
            lab.notes.append(f"ckptd {v.name}: transport=\"shm\" was asked for, but the daemon does not map the "
                             "producer's staging arena: the tensors went inline through the socket (this ckptd "
                             "does not do shm yet, or fell back)")
        elif v.transport != "shm" and maps:
            lab.notes.append(f"ckptd {v.name}: transport=\"inline\" was asked for, but the daemon maps the arena")


# -- the run ------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    for var in ENV_ISOLATE:
        os.environ.pop(var, None)
    base = Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir=args.dir)).resolve()
    lab = Lab(base)
    try:
        print(f"a {args.size_bytes / 2**30:.2f} GiB state in {args.tensors} tensors under {base}; "
              "starting daemons and workers ...", flush=True)
        check_disk(base, args.size_bytes)
        check_memory(args, lab)
        start_lab(args, lab)
        bench = Bench(args, lab)
        print("warm-up round ...", flush=True)
        bench.one_round(record=False)
        check_shm(lab)
        if args.py_spy is not None and lab.variants:
            lab.spy = PySpy(lab.variants[0].daemon.pid, args.py_spy.resolve(), args.py_spy_idle)
        for i in range(args.repeat):
            print(f"repeat {i + 1}/{args.repeat} ...", flush=True)
            bench.one_round(record=True)
        return finish(args, lab, bench)
    except BaseException:
        for v in lab.variants:
            if v.daemon.proc is not None and v.daemon.proc.poll() is not None:
                print(f"daemon {v.name} (exited {v.daemon.proc.returncode}), last lines:\n{v.daemon.log_tail(20)}",
                      file=sys.stderr)
        raise
    finally:
        lab.teardown()
        if lab.spy is not None:
            print(f"daemon profile ({lab.variants[0].name}): {args.py_spy}")
        if args.keep:
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


def finish(args: argparse.Namespace, lab: Lab, bench: Bench) -> dict[str, Any]:
    """Summaries, goals, the table and the chart; returns everything for --json."""
    bench.add_daemon_figures()
    assert lab.payload is not None
    nbytes = lab.payload.layout.nbytes
    loads = [r["loadavg_1min"] for r in bench.records.pop("_loadavg", [])]
    stats = report.summarize(bench.records, nbytes)
    variants = [(v.transport, v.format) for v in lab.variants if v.worker is not None]
    rows = report.rows_for(variants, list(args.api))
    ckptd_keys = [r.key for r in rows if r.group == "ckptd"]
    budgets = {report.ckptd_key(v.transport, v.format, api): v.daemon.settings().memory_budget / MiB
               for v in lab.variants for api in args.api}
    payload_mib, arena_mib = nbytes / MiB, args.staging_bytes / MiB
    base = worker_base_rss(lab)
    torch_base = {report.ckptd_key(v.transport, v.format, api): base[v.worker.name]["python_torch"]
                  for v in lab.variants if v.worker is not None and v.worker.name in base for api in args.api}
    goal_table = report.goals(stats, ckptd_keys, payload_mib, arena_mib, budgets, torch_base)
    for v in lab.variants:
        lab.notes += [f"daemon {v.name} log: {line}" for line in v.daemon.problems()[:5]]

    report.print_table(rows, stats, nbytes, args.tensors, args.repeat)
    report.print_detail(rows, stats, nbytes)
    limits = report.goal_limits(stats, payload_mib, arena_mib, budgets)
    report.print_goals(goal_table, {r.key: r.label for r in rows}, limits)
    print_base_rss(lab)
    if loads:
        print(f"load average (1 min) at each repeat: {', '.join(f'{x:.1f}' for x in loads)} on {os.cpu_count()} "
              "CPUs (other tenants make wall times noisy)")
    for note in lab.notes:
        print(f"note: {note}")

    env = environment(args, lab.base, nbytes)
    fstype = env["df"].split()[1] if len(env["df"].split()) > 1 else "?"
    title = (f"ckptd report: {nbytes / 2**30:.2f} GiB in {args.tensors} float32 tensors, {args.repeat} repeat(s), "
             f"{env['cpus']} CPUs, {fstype} at {args.dir or tempfile.gettempdir()}, git {env['git_commit'][:10]}")
    if args.png is not None:
        args.png.parent.mkdir(parents=True, exist_ok=True)
        lines = report.chart_lines(stats, payload_mib, arena_mib, budgets)
        report.write_png(args.png, rows, stats, title, lines)
        print(f"chart: {args.png}")
    env["daemons"] = {v.name: dataclasses.asdict(v.daemon.settings()) for v in lab.variants if v.worker is not None}
    return {"config": env, "records": bench.records, "stats": stats,
            "goals": {k: {n: g.to_dict() for n, g in gs.items()} for k, gs in goal_table.items()},
            "worker_base_rss_mib": worker_base_rss(lab), "loadavg_1min": loads, "notes": lab.notes}


def worker_base_rss(lab: Lab) -> dict[str, dict[str, float]]:
    """Each worker's RSS before it measured anything: bare interpreter, + torch, + the payload
    mapped, + its saver set up (the memcpy target, DCP, the producer and its arena)."""
    workers = [lab.baseline, *(d.worker for d in lab.dcps), *(v.worker for v in lab.variants)]
    return {w.name: {k: v / MiB for k, v in w.ready["rss"].items()} for w in workers if w is not None and w.ready}


def print_base_rss(lab: Lab) -> None:
    base = worker_base_rss(lab)
    if not base:
        return
    torch_mib = sorted(b["python_torch"] for b in base.values())[len(base) // 2]
    print(f"\nbase RSS of a worker: {torch_mib:.0f} MiB for the interpreter with torch imported (median), before "
          "the payload and the saver; ready to measure, in MiB:")
    print("  " + ", ".join(f"{name} {b['ready']:.0f}" for name, b in base.items()))


# -- command line ------------------------------------------------------------------------------------------------
def _csv(allowed: tuple[str, ...]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)} (comma-separated), not {text!r}")
        return items

    return parse


def _key_value(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)  # numbers, true/false, quoted strings
    except json.JSONDecodeError:
        return key, value  # a bare string such as 512MiB


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="total bytes of the state (default 1GiB)")
    ap.add_argument("--tensors", type=int, default=64, help="number of float32 tensors (default 64)")
    ap.add_argument("--repeat", type=int, default=5, help="measured repeats after one warm-up (default 5)")
    ap.add_argument("--json", type=Path, help="write every raw number, the summary and the goals here")
    ap.add_argument("--png", type=Path, default=None,
                    help="write the chart here (default: next to --json as .png, else benchmarks/results/report.png)")
    ap.add_argument("--no-png", action="store_true", help="draw no chart")
    ap.add_argument("--dir", type=Path, default=None,
                    help="parent of the temp folder holding the checkpoint roots and baseline files "
                         "(default: the system temp dir); every disk figure is for this filesystem")
    ap.add_argument("--transports", type=_csv(TRANSPORTS), default=TRANSPORTS,
                    help="ckptd transports to measure (default shm,inline,tcp)")
    ap.add_argument("--formats", type=_csv(FORMATS), default=FORMATS, help="ckptd formats (default chunk,hdf5)")
    ap.add_argument("--api", type=_csv(APIS), default=APIS, help="ckptd calls to measure (default emit,save)")
    ap.add_argument("--chunk-size", default=None, help="daemon chunk_size (default: the daemon's default)")
    ap.add_argument("--memory-budget", default=None, help="daemon memory_budget (default: the daemon's default)")
    ap.add_argument("--daemon-set", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                    help="another [daemon] key for every daemon, e.g. direct_io=false (repeatable)")
    ap.add_argument("--staging", default=None, help="producer staging_size (default: state size + slack)")
    ap.add_argument("--block", default="64MiB", help="os.write block size of the raw writes (default 64MiB)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for one commit")
    ap.add_argument("--daemon-nice", type=int, default=0,
                    help="start the daemons at this nice value (what-if: a writer that yields the CPU)")
    ap.add_argument("--daemon-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for the daemons, e.g. MALLOC_ARENA_MAX=1 (repeatable)")
    ap.add_argument("--no-dcp", action="store_true", help="skip the torch.distributed.checkpoint baselines")
    ap.add_argument("--py-spy", type=Path, default=None,
                    help="profile the first variant's daemon with py-spy into this file (.svg flamegraph, "
                         ".json speedscope, else raw collapsed stacks)")
    ap.add_argument("--py-spy-idle", action="store_true", help="include idle (waiting) samples in the profile")
    ap.add_argument("--keep", action="store_true", help="keep the temp folder (configs and logs)")
    args = ap.parse_args(argv)
    args.size_bytes = parse_size(args.size)
    args.block = parse_size(args.block)
    if args.tensors < 1 or args.repeat < 1 or args.size_bytes < 4 * args.tensors:
        ap.error("need --tensors >= 1, --repeat >= 1 and at least 4 bytes per tensor")
    if args.block % 4096:
        ap.error("--block must be a multiple of 4096 (O_DIRECT)")
    if any("=" not in kv for kv in args.daemon_env):
        ap.error("--daemon-env takes KEY=VALUE")
    args.daemon_env = dict(kv.split("=", 1) for kv in args.daemon_env)
    args.daemon_set = dict(args.daemon_set)
    # staging: the state plus alignment slack (large regions start on a page)
    args.staging_bytes = parse_size(args.staging) if args.staging else args.size_bytes + 4096 * (args.tensors + 1)
    if args.no_png:
        args.png = None
    elif args.png is None:
        args.png = args.json.with_suffix(".png") if args.json else Path(__file__).resolve().parent / "results" / "report.png"
    return args


def check_disk(base: Path, nbytes: int) -> None:
    """At most one checkpoint or baseline file exists at a time, but DCP and the page cache
    want headroom: refuse to start with less than twice the state free."""
    free = shutil.disk_usage(base).free
    if free < 2 * nbytes + 2**30:
        raise SystemExit(f"only {free / 2**30:.1f} GiB free under {base}; "
                         f"need {(2 * nbytes + 2**30) / 2**30:.1f} GiB (use --dir elsewhere or a smaller --size)")


def check_memory(args: argparse.Namespace, lab: Lab) -> None:
    """A rough need: the payload once (shared), the memcpy target, one arena per ckptd
    variant, DCP's staging copies (about four payloads), ~300 MiB per process. Short of it,
    the run would swap or be killed: say so before starting."""
    variants = len(args.transports) * len(args.formats)
    need = (2 * args.size_bytes + variants * args.staging_bytes + (0 if args.no_dcp else 4 * args.size_bytes)
            + (4 + 2 * variants) * 300 * MiB)
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return
    if need > avail:
        lab.notes.append(f"this run wants about {need / 2**30:.1f} GiB of memory and {avail / 2**30:.1f} GiB are "
                         "available: figures may include swapping (fewer --transports/--formats, or --no-dcp)")
        print(f"warning: {lab.notes[-1]}", file=sys.stderr)


def environment(args: argparse.Namespace, base: Path, nbytes: int) -> dict[str, Any]:
    """What the numbers depend on, saved with them."""
    commit = ""
    with contextlib.suppress(OSError):
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent).stdout.strip()
    fs = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
        fs = subprocess.run(["df", "-T", str(base)], capture_output=True, text=True).stdout.splitlines()[-1]
    return {"size_bytes": nbytes, "tensors": args.tensors, "repeat": args.repeat, "transports": args.transports,
            "formats": args.formats, "api": args.api, "chunk_size": args.chunk_size,
            "memory_budget": args.memory_budget, "daemon_set": args.daemon_set, "staging_bytes": args.staging_bytes,
            "block": args.block, "daemon_nice": args.daemon_nice, "daemon_env": args.daemon_env,
            "dir": str(base), "df": fs, "git_commit": commit, "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "platform": platform.platform(), "time": time.time()}


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: everything stopped, temp removed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--limits"]:  # docs/performance.md's figures: the stall, write path, HDF5 and resume at their floors
        import limits

        return limits.main(argv[1:])
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    result = run(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"raw numbers: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
