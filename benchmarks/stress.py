#!/usr/bin/env python3
"""Faults, hostile input and load against a real ``ckptd serve``.

    nice .venv/bin/python benchmarks/stress.py --kills 100 --frames 100000 --load-seconds 60 --producers 16 --runs 4
    .venv/bin/python benchmarks/stress.py --quick          # a small version of all three, about a minute
    .venv/bin/python benchmarks/stress.py --only kill --kills 20 --json out.json
    .venv/bin/python benchmarks/stress.py --only model --model-seconds 3600   # an hour of the save-path model

Four scenarios, each with real parts only: a ``ckptd serve`` subprocess, real
ZeroMQ sockets, producer processes that checkpoint continuously, files on disk.

* **kill**: the daemon is killed with SIGKILL at random instants while several
  producers checkpoint, and restarted. After each restart (producers paused
  with SIGSTOP, so that nothing new is written while we look): no orphan file
  survived the start-up clean-up, every listed checkpoint loads bit-exactly with
  ``ckptd.load(..., verify=True)``, and every acknowledged commit is still there
  (unless retention removed it legitimately) and verifies.
* **fuzz**: malformed messages (``benchmarks/hostile.py``) from many identities
  at the daemon's socket while a good producer checkpoints beside them. The
  daemon must not die, its peak RSS must stay under ``memory_budget`` + 200 MiB,
  and the good producer must lose nothing and fail nothing.
* **load**: many producers (``--runs`` runs of ``--producers / --runs`` ranks,
  each a process) checkpoint continuously for ``--load-seconds``. Every
  acknowledged commit must be on disk and verify; the daemon's peak RSS must stay
  under ``memory_budget`` + 200 MiB; commit latency percentiles are reported.
* **model**: ``tests/test_model.py``'s randomized model of the save path (random
  states of every dtype and size, tied storage, numpy arrays, DTensor pieces; saves
  and emit blocks, plan hits and misses, frozen= and replicated=; random staging,
  chunk_size, format and reuse) in fresh random rounds for ``--model-seconds``:
  every step must finish within a bound, load back bit-exactly, verify, and hold
  exactly its tensors in its files. CI runs the same model briefly, from a fixed seed.

Every producer writes one JSON line per step it tried (``ok``, latency, error);
the content of a step is a pure function of (run, rank, step), so the harness
can check every byte without keeping copies. The report says how many kills
the daemon survived, how many malformed messages it got, how many checkpoint
shares (one rank of one step) were verified, how many acknowledged bytes were
lost (must be 0), the daemon's peak RSS and the commit latency p50/p99. Any
violated guarantee is listed, and the exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

import ckptd
from ckptd import CheckpointError, layout, measures
from ckptd.config import parse_size
from ckptd.daemon.launcher import ServeProcess
from ckptd.errors import CheckpointCorrupt, CheckpointNotFound
from ckptd.manifest import Manifest
from ckptd.reader import read_tensors
from ckptd.retention import POLICY_FILE, TRASH_PREFIX
from ckptd.state import flatten

HERE = Path(__file__).resolve().parent
MiB = 2**20
RSS_SLACK = 200 * MiB  # the daemon's peak RSS may exceed memory_budget by this much
_ENV_ISOLATE = ("CKPTD_CONFIG", "CKPTD_ENDPOINT", "CKPTD_RUN", "CKPTD_ROOT", "RANK", "WORLD_SIZE", "NOTIFY_SOCKET")
Say = Callable[[str], None]


# -- what each step holds: a pure function of (run, rank, step) ----------------------------
class States:
    """Step contents without storing them: a small tag tensor naming (run, rank, step),
    plus, per size, one of ``versions`` random tensors picked by the step."""

    DTYPES = (torch.uint8, torch.bfloat16, torch.float32, torch.float32)

    def __init__(self, sizes: list[int], versions: int = 5) -> None:
        self.sizes = sizes
        self.versions = versions
        self._pools: dict[tuple[str, int], list[list[torch.Tensor]]] = {}

    def _pool(self, run: str, rank: int) -> list[list[torch.Tensor]]:
        key = (run, rank)
        if key not in self._pools:
            g = torch.Generator().manual_seed(zlib.crc32(f"{run}/{rank}".encode()))
            pool = []
            for i, size in enumerate(self.sizes):
                dtype = self.DTYPES[i % len(self.DTYPES)]
                n = max(1, size // dtype.itemsize)
                if dtype == torch.uint8:
                    pool.append([torch.randint(0, 256, (n,), dtype=dtype, generator=g) for _ in range(self.versions)])
                else:
                    pool.append([torch.randn(n, generator=g).to(dtype) for _ in range(self.versions)])
            self._pools[key] = pool
        return self._pools[key]

    def nested(self, run: str, rank: int, step: int) -> dict[str, Any]:
        """The state as ``save`` gets it: ``{"tag": t, "w": {"t0": ..., "t1": ...}}``."""
        tag = torch.tensor([zlib.crc32(run.encode()), rank, step], dtype=torch.int64)
        pool = self._pool(run, rank)
        return {"tag": tag, "w": {f"t{i}": v[(step + i) % len(v)] for i, v in enumerate(pool)}}

    def flat(self, run: str, rank: int, step: int) -> dict[str, torch.Tensor]:
        """The same as ``{name: tensor}``: what ``emit`` sends and what loading gives back."""
        return flatten(self.nested(run, rank, step))[1]

    def nbytes(self, run: str, rank: int, step: int) -> int:
        return sum(t.numel() * t.element_size() for t in self.flat(run, rank, step).values())


def mismatch(got: dict[str, Any], want: dict[str, torch.Tensor]) -> str | None:
    """Why ``got`` is not bit for bit ``want``, or None."""
    if set(got) != set(want):
        return f"tensor names {sorted(got)} != {sorted(want)}"
    for name, w in want.items():
        g = got[name]
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"{name}: {g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}"
        if not torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)):
            return f"{name}: bytes differ"
    return None


# -- the daemon -------------------------------------------------------------------------------
class Daemon(ServeProcess):
    """A ``ckptd serve`` subprocess (ckptd/daemon/launcher.py: ready means READY=1, sent
    only after the start-up clean-up, docs/service.md), its root ``base/root``, and the
    peak RSS of all its incarnations."""

    def __init__(self, base: Path, tables: dict[str, dict[str, Any]] | None = None, *, nofile: int | None = None,
                 **keys: Any) -> None:
        self.base = base
        self.nofile = nofile  # its RLIMIT_NOFILE soft limit; systemd's default for services is 1024
        super().__init__(base, {"daemon": {"root": str(base / "root"), **keys}, **(tables or {})})
        self.memory_budget = parse_size(keys.get("memory_budget", 2 * 2**30))
        self.starts = 0
        self.peak_rss = 0  # VmHWM, the kernel's own peak, over every incarnation

    def start(self, timeout: float = 60.0) -> "Daemon":  # type: ignore[override]
        env = {k: v for k, v in os.environ.items() if k not in _ENV_ISOLATE}
        super().start(timeout=timeout, env=env, preexec_fn=self._limits)
        self.starts += 1
        return self

    def _limits(self) -> None:  # in the child, before exec
        if self.nofile is not None:
            import resource

            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, hard))

    def memory(self) -> tuple[int, int]:
        """(VmRSS, VmHWM) in bytes, from /proc; (0, 0) once it is gone."""
        rss = hwm = 0
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss = int(line.split()[1]) * 1024
                    elif line.startswith("VmHWM:"):
                        hwm = int(line.split()[1]) * 1024
        except (FileNotFoundError, ProcessLookupError):
            pass
        self.peak_rss = max(self.peak_rss, hwm, rss)
        return rss, hwm

    def kill(self) -> None:
        """kill -9, as a crash would; the stale socket file stays, as after a real crash."""
        self.memory()
        super().kill()

    def stop(self, timeout: float = 60.0) -> int:
        self.memory()
        return super().stop(timeout)

    def cleanup(self) -> None:
        if self.alive():
            super().kill()
        self.close()


class RssSampler:
    """Samples the daemon's VmRSS every ``interval`` s on a thread (VmHWM is the exact peak;
    this keeps a time series for the report)."""

    def __init__(self, daemon: Daemon, interval: float = 0.1) -> None:
        self.daemon = daemon
        self.interval = interval
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stress-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.daemon.alive():
                self.samples.append(self.daemon.memory()[0])

    def close(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.samples, default=0)


# -- producer processes ---------------------------------------------------------------------------
@dataclass
class Worker:
    """One producer process (this script's ``producer`` subcommand) and its record file."""

    run: str
    rank: int
    world_size: int
    out: Path
    proc: subprocess.Popen
    seen: int = 0  # records already checked
    stopping: bool = False

    @classmethod
    def spawn(cls, daemon: Daemon, run: str, rank: int, world_size: int, sizes: list[int], *,
              staging: str, timeout: float = 5.0, heartbeat: float = 0.5, emit_timeout: float = 60.0,
              hang_limit: float = 120.0, transport: str = "auto") -> "Worker":
        out = daemon.base / f"producer-{run}-{rank}.jsonl"
        env = {k: v for k, v in os.environ.items() if k not in _ENV_ISOLATE}
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, str(Path(__file__).resolve()), "producer", "--endpoint", daemon.endpoint,
               "--run", run, "--rank", str(rank), "--world-size", str(world_size), "--out", str(out),
               "--sizes", ",".join(map(str, sizes)), "--staging", staging, "--timeout", str(timeout),
               "--heartbeat", str(heartbeat), "--emit-timeout", str(emit_timeout), "--hang-limit", str(hang_limit),
               "--transport", transport]
        with open(daemon.base / f"producer-{run}-{rank}.log", "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
        return cls(run, rank, world_size, out, proc)

    def records(self) -> list[dict[str, Any]]:
        try:
            text = self.out.read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]

    def acked(self) -> int:
        return sum(1 for r in self.records() if r["ok"])

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop_soon(self) -> None:
        """Ask it to stop after the step in progress (once: a second SIGTERM could find it
        past its handler, in interpreter shutdown)."""
        if not self.stopping:
            self.stopping = True
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)

    def finish(self, timeout: float = 120.0) -> int | None:
        """Stop it after the step in progress and wait; kill it if it does not stop."""
        self.stop_soon()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


def producer_main(args: argparse.Namespace) -> int:
    """The ``producer`` subcommand: checkpoint steps 1, 2, 3, ... until SIGTERM, alternating
    ``save`` and ``emit`` in a ``checkpoint`` block; one JSON line per step tried."""
    torch.set_num_threads(1)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    states = States([int(s) for s in args.sizes.split(",")])
    p = ckptd.Producer(args.endpoint, args.run, rank=args.rank, world_size=args.world_size,
                       staging_size=args.staging, timeout=args.timeout, heartbeat=args.heartbeat,
                       emit_timeout=args.emit_timeout, transport=args.transport)
    step = 0
    with open(args.out, "a", buffering=1) as out:
        while not stop.is_set():
            step += 1
            rec: dict[str, Any] = {"step": step, "nbytes": states.nbytes(args.run, args.rank, step)}
            t0 = time.monotonic()
            try:
                if step % 2:
                    handle = p.save(states.nested(args.run, args.rank, step), step)
                else:
                    with p.checkpoint(step) as handle:
                        for name, t in states.flat(args.run, args.rank, step).items():
                            p.emit(name, t)
                blocked = time.monotonic() - t0
                handle.wait(args.hang_limit)
                rec.update(ok=True, blocked=blocked)
            except CheckpointError as exc:
                rec.update(ok=False, err=str(exc)[:400], hang="was not acknowledged within" in str(exc))
            rec["lat"] = time.monotonic() - t0
            out.write(json.dumps(rec) + "\n")
            if not rec["ok"]:
                stop.wait(0.05)  # the daemon is away: do not spin
    try:
        p.close()
    except CheckpointError:
        pass  # failures were recorded already
    return 0


# -- checking the root ------------------------------------------------------------------------------
def _is_measures(name: str) -> bool:
    return name.startswith(measures.PREFIX) and name.endswith(".json")


def _in_flight(name: str) -> bool:
    """A file being replaced right now by a live process of this host
    (``.<name>~<host>-<pid>.tmp``, ckptd/durable.py): the daemon's own, not an orphan."""
    host, _, pid = name.removesuffix(".tmp").rpartition("~")[2].rpartition("-")
    if not (name.startswith(".") and name.endswith(".tmp") and host == socket.gethostname() and pid.isdigit()):
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def orphans(root: Path) -> list[str]:
    """Files that the start-up clean-up should have removed: in a step folder, anything no
    manifest names; in a run folder, anything but step folders, `latest` and the run's
    retention file and the daemons' measures files (ckptd/measures.py), and the files a live
    daemon is replacing right now; leftover trash folders; empty step folders."""
    found = []
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for entry in sorted(run_dir.iterdir()):
            if entry.name.startswith(TRASH_PREFIX):
                found.append(f"trash left: {entry}")
            elif entry.is_dir() and layout.parse_step_dir(entry.name) is not None:
                names = set(os.listdir(entry))
                referenced: set[str] = set()
                for m in entry.glob("manifest-r*.json"):
                    referenced.add(m.name)
                    referenced.update(t["file"] for t in json.loads(m.read_bytes())["tensors"].values())
                if names - referenced:
                    found.append(f"orphans in {entry}: {sorted(names - referenced)}")
                if not names:
                    found.append(f"empty step folder left: {entry}")
            elif entry.name not in ("latest", POLICY_FILE) and not _is_measures(entry.name) \
                    and not _in_flight(entry.name):
                found.append(f"stray entry in a run folder: {entry}")
    return found


@dataclass
class Ledger:
    """What the producers were told, checked against the disk."""

    root: Path
    states: States
    keep_last: int = 0  # the retention rule in force (0: none: every ack must stay)
    verified: set[tuple[str, int, int]] = field(default_factory=set)  # (run, rank, step) shares
    acked: int = 0
    acked_bytes: int = 0
    failed: int = 0
    hangs: int = 0
    lost_bytes: int = 0
    retired: int = 0  # acknowledged, then removed by retention (legitimately)
    latencies: list[float] = field(default_factory=list)
    blocked: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)  # error text (shortened) -> count
    violations: list[str] = field(default_factory=list)

    def _verify(self, run: str, rank: int, step: int, complete: bool) -> str | None:
        """Read one rank's share with every checksum checked; compare bit for bit."""
        key = (run, rank, step)
        if key in self.verified:
            return None
        want = self.states.flat(run, rank, step)
        try:
            if complete:  # the public path: ckptd.load(..., verify=True)
                got = flatten(ckptd.load(run, step, root=self.root, rank=rank, verify=True))[1]
            else:  # an acknowledged share of a step other ranks have not completed
                path = layout.step_dir(self.root, run, step)
                mpath = path / layout.manifest_name(rank)
                manifest = Manifest.from_json(mpath.read_bytes(), str(mpath))
                got = read_tensors(path, manifest.tensors, verify=True)
        except FileNotFoundError:
            return "missing"
        except (CheckpointCorrupt, CheckpointNotFound) as exc:
            return f"{type(exc).__name__}: {exc}"
        problem = mismatch(got, want)
        if problem is None:
            self.verified.add(key)
        return problem

    def check(self, workers: list[Worker], when: str) -> None:
        """Every listed checkpoint verifies; every new acknowledgement is on disk and verifies."""
        runs = sorted({w.run for w in workers})
        listed: dict[str, list[int]] = {}
        for run in runs:
            infos = ckptd.list_checkpoints(run, root=self.root)
            listed[run] = [i.step for i in infos]
            world = {w.run: w.world_size for w in workers}[run]
            for info in infos:
                for rank in range(world):
                    problem = self._verify(run, rank, info.step, complete=True)
                    if problem:
                        self.violations.append(f"{when}: listed {run} step {info.step} rank {rank}: {problem}")
        for w in workers:
            records = w.records()
            new, w.seen = records[w.seen:], len(records)
            for r in new:
                if not r["ok"]:
                    self.failed += 1
                    self.hangs += bool(r.get("hang"))
                    if r.get("hang"):
                        self.violations.append(f"{when}: {w.run} rank {w.rank} step {r['step']}: {r['err']}")
                    text = _shorten(r.get("err", ""))
                    self.failures[text] = self.failures.get(text, 0) + 1
                    continue
                self.acked += 1
                self.acked_bytes += r["nbytes"]
                self.latencies.append(r["lat"])
                self.blocked.append(r.get("blocked", 0.0))
                self._check_ack(w, r, listed[w.run], when)

    def _check_ack(self, w: Worker, r: dict[str, Any], listed: list[int], when: str) -> None:
        step = r["step"]
        step_path = layout.step_dir(self.root, w.run, step)
        if not step_path.exists() and self.keep_last and len(listed) >= self.keep_last \
                and step < listed[-self.keep_last]:
            self.retired += 1  # older than the keep_last newest complete steps: retention's to remove
            return
        problem = self._verify(w.run, w.rank, step, complete=step in listed)
        if problem:
            self.lost_bytes += r["nbytes"]
            self.violations.append(f"{when}: acknowledged {w.run} step {step} rank {w.rank}: {problem}")


def _shorten(text: str) -> str:
    """An error message without its variable parts, to count failures by kind."""
    for cut in (" within ", ": step ", " (", "; "):
        text = text.split(cut)[0]
    return text[:120]


def _wait_for(cond: Callable[[], bool], timeout: float, what: str, daemon: Daemon | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if daemon is not None and not daemon.alive():
            raise RuntimeError(f"the daemon died while waiting until {what}:\n{daemon.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting until {what}")
        time.sleep(0.05)


def _kill_all(workers: list[Worker]) -> None:
    """kill -9 what still runs (the scenario failed or was interrupted)."""
    for w in workers:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()


def _stop(d: Daemon, ledger: Ledger) -> None:
    """SIGTERM: a clean drain exits 0; anything else is a violation."""
    code = d.stop()
    if code != 0:
        ledger.violations.append(f"the daemon exited with {code} on SIGTERM")


def _check_rss(d: Daemon, ledger: Ledger) -> None:
    if d.peak_rss >= d.memory_budget + RSS_SLACK:
        ledger.violations.append(f"daemon peak RSS {d.peak_rss / MiB:.0f} MiB >= memory_budget "
                                 f"{d.memory_budget / MiB:.0f} MiB + {RSS_SLACK // MiB} MiB")


def _latency(ledger: Ledger) -> dict[str, float | None]:
    lat = sorted(ledger.latencies)
    if not lat:
        return {"p50_s": None, "p99_s": None, "max_s": None}
    pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
    return {"p50_s": pick(0.50), "p99_s": pick(0.99), "max_s": lat[-1]}


# -- scenario 1: kill -9 of the daemon ----------------------------------------------------------------
KILL_SIZES = [4096, 256 * 1024, 6 * MiB]  # 6 MiB > 4 MiB staging: it travels in pieces, and streams


def kill_loop(base: Path, *, kills: int, producers: int = 3, seed: int = 0, pause: tuple[float, float] = (0.05, 1.5),
              say: Say = print) -> dict[str, Any]:
    """Kill the daemon ``kills`` times at random instants while ``producers`` processes
    checkpoint (runs of two ranks, then one); check the root after every restart."""
    rng = random.Random(seed)
    keep_last = 2
    d = Daemon(base / "kill", tables={"retention": {"keep_last": keep_last}}, chunk_size="1MiB",
               memory_budget="64MiB", session_timeout="10s", log_level="info")
    ledger = Ledger(d.root, States(KILL_SIZES), keep_last=keep_last)
    runs = [(f"k{i}", min(2, producers - 2 * i)) for i in range((producers + 1) // 2)]  # ranks of 2, then 1
    workers: list[Worker] = []
    survived = 0
    t0 = time.monotonic()
    try:
        d.start()
        for i, (run, world) in enumerate(runs):
            for rank in range(world):  # every other run sends inline, the rest through shared memory
                workers.append(Worker.spawn(d, run, rank, world, KILL_SIZES, staging="4MiB", timeout=2.0,
                                            heartbeat=0.25, emit_timeout=30.0, transport="inline" if i % 2 else "auto"))
        _wait_for(lambda: all(w.acked() for w in workers), 180, "every producer has a commit acknowledged", d)
        for i in range(kills):
            before = [w.acked() for w in workers]
            time.sleep(rng.uniform(*pause))
            d.kill()
            for w in workers:
                w.signal(signal.SIGSTOP)  # nothing new reaches the root while we look
            d.start()  # READY=1 comes after the start-up clean-up
            found = orphans(d.root)
            ledger.violations += [f"after kill {i + 1}: {o}" for o in found]
            ledger.check(workers, f"after kill {i + 1}")
            for w in workers:
                w.signal(signal.SIGCONT)
            survived += 1
            if (i + 1) % 10 == 0 or i + 1 == kills:
                say(f"  kill {i + 1}/{kills}: {ledger.acked} acked, {ledger.failed} failed (told), "
                    f"{len(ledger.verified)} shares verified, {len(ledger.violations)} violation(s)")
            # every producer reconnects and gets a commit through before the next kill
            _wait_for(lambda: all(w.acked() > b for w, b in zip(workers, before)), 120,
                      f"every producer has a new commit after restart {i + 1}", d)
        for w in workers:
            if w.finish() != 0:
                ledger.violations.append(f"producer {w.run} rank {w.rank} exited with {w.proc.returncode}")
        ledger.check(workers, "at the end")
        _stop(d, ledger)
        ledger.violations += [f"after the final stop: {o}" for o in orphans(d.root)]
    finally:
        _kill_all(workers)
        d.cleanup()
    return {
        "kills": kills, "kills_survived": survived, "producers": len(workers),
        "commits_acked": ledger.acked, "commits_failed": ledger.failed, "hangs": ledger.hangs,
        "acked_bytes": ledger.acked_bytes, "retired_by_retention": ledger.retired,
        "shares_verified": len(ledger.verified), "bytes_lost": ledger.lost_bytes,
        "peak_rss": d.peak_rss, "failures": ledger.failures, "latency": _latency(ledger),
        "seconds": time.monotonic() - t0, "violations": ledger.violations,
    }


# -- scenario 2: hostile wire input beside a good producer ----------------------------------------------
FUZZ_SIZES = [4096, 256 * 1024, 2 * MiB]


def live_fuzz(base: Path, *, messages: int, seed: int = 0, memory_budget: str = "32MiB",
              say: Say = print) -> dict[str, Any]:
    """Send ``messages`` malformed messages at the daemon while a good producer checkpoints."""
    sys.path.insert(0, str(HERE))
    from hostile import Fuzzer, Stalled

    rng = random.Random(seed)
    # drain_timeout: the fuzzer's half-sent steps are failed 10 s into the SIGTERM, well within stop()'s wait
    d = Daemon(base / "fuzz", chunk_size="1MiB", memory_budget=memory_budget, max_frame="1MiB",
               session_timeout="5s", drain_timeout="10s", log_level="info", nofile=1024)
    ledger = Ledger(d.root, States(FUZZ_SIZES))
    good: Worker | None = None
    fuzzer = None
    sampler = None
    t0 = time.monotonic()
    try:
        d.start()
        good = Worker.spawn(d, "good", 0, 1, FUZZ_SIZES, staging="4MiB", timeout=10.0, heartbeat=1.0,
                            emit_timeout=60.0)
        _wait_for(lambda: good.acked() > 0, 180, "the good producer has a commit acknowledged", d)
        acked_before = good.acked()
        sampler = RssSampler(d)
        fuzzer = Fuzzer(d.endpoint, rng, avoid_runs=("good",), chunk_size=MiB)
        last_progress, last_acked = time.monotonic(), acked_before
        try:
            while fuzzer.counts.malformed < messages:
                fuzzer.send_one()
                if fuzzer.counts.messages % 500 == 0:
                    if not d.alive():
                        ledger.violations.append(
                            f"the daemon died after {fuzzer.counts.messages} fuzz messages:\n{d.log_tail()}")
                        break
                    acked = good.acked()
                    if acked > last_acked:
                        last_progress, last_acked = time.monotonic(), acked
                    elif time.monotonic() - last_progress > 60:
                        ledger.violations.append("the good producer got no commit through for 60 s")
                        break
                    if fuzzer.counts.messages % 20_000 == 0:
                        say(f"  fuzz: {fuzzer.counts.malformed} malformed sent, daemon RSS "
                            f"{d.memory()[0] / MiB:.0f} MiB, good producer {acked} acked")
        except Stalled as exc:
            ledger.violations.append(f"{exc} (after {fuzzer.counts.messages} messages)")
        fuzzer.drain()
        if d.alive():
            try:
                report = d.status()
                if not isinstance(report.get("queued_bytes"), int):
                    ledger.violations.append(f"odd status report after the fuzz: {report}")
            except CheckpointError as exc:
                ledger.violations.append(f"the daemon did not answer `status` after the fuzz: {exc}")
            # the good producer still gets commits through once the fuzz is over
            after = good.acked()
            try:
                _wait_for(lambda: good.acked() > after + 1, 60, "the good producer commits after the fuzz", d)
            except RuntimeError as exc:
                ledger.violations.append(str(exc))
        else:
            ledger.violations.append(f"the daemon is dead after the fuzz:\n{d.log_tail()}")
        peak_sampled = sampler.close()
        sampler = None
        if good.finish() != 0:
            ledger.violations.append(f"the good producer exited with {good.proc.returncode}")
        ledger.check([good], "fuzz")
        if ledger.failed:
            ledger.violations.append(f"the good producer had {ledger.failed} failed commit(s): {ledger.failures}")
        if good.acked() <= acked_before:
            ledger.violations.append("the good producer got no commit through during the fuzz")
        if d.alive():
            d.memory()
            _stop(d, ledger)
        _check_rss(d, ledger)
    finally:
        if sampler is not None:
            sampler.close()
        if fuzzer is not None:
            fuzzer.close()
        if good is not None and good.proc.poll() is None:
            good.proc.kill()
            good.proc.wait()
        d.cleanup()
    c = fuzzer.counts
    return {
        "messages": c.messages, "malformed": c.malformed, "frames": c.frames, "identities": c.identities,
        "replies": c.replies, "error_replies": c.errors, "stalled_s": c.stalled_s, "kinds": c.kinds,
        "handoffs": c.handoffs, "handoffs_cut": c.handoffs_cut,
        "good_commits_acked": ledger.acked, "good_commits_failed": ledger.failed,
        "shares_verified": len(ledger.verified), "bytes_lost": ledger.lost_bytes,
        "memory_budget": d.memory_budget, "peak_rss": d.peak_rss, "peak_rss_sampled": peak_sampled,
        "latency": _latency(ledger), "seconds": time.monotonic() - t0, "violations": ledger.violations,
    }


# -- scenario 3: load ----------------------------------------------------------------------------------------
LOAD_SIZES = [4096, 256 * 1024, MiB]


def load(base: Path, *, seconds: float, producers: int = 16, runs: int = 4, memory_budget: str = "64MiB",
         sizes: list[int] = LOAD_SIZES, say: Say = print) -> dict[str, Any]:
    """``producers`` processes in ``runs`` runs checkpoint continuously for ``seconds``."""
    if producers % runs:
        raise ValueError(f"--producers {producers} is not a multiple of --runs {runs}")
    world = producers // runs
    d = Daemon(base / "load", chunk_size="1MiB", memory_budget=memory_budget, log_level="info")
    ledger = Ledger(d.root, States(sizes))
    workers: list[Worker] = []
    sampler = None
    t0 = time.monotonic()
    try:
        d.start()
        for r in range(runs):
            for rank in range(world):
                workers.append(Worker.spawn(d, f"load{r}", rank, world, sizes, staging="4MiB",  # odd runs inline
                                            timeout=30.0, heartbeat=2.0, emit_timeout=120.0,
                                            transport="inline" if r % 2 else "auto"))
        _wait_for(lambda: all(w.acked() for w in workers), 300, "every producer has a commit acknowledged", d)
        sampler = RssSampler(d)
        status_max = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            if not d.alive():
                ledger.violations.append(f"the daemon died under load:\n{d.log_tail()}")
                break
            try:
                status_max = max(status_max, d.status()["queued_bytes"])
            except CheckpointError:
                pass  # busy; RSS is the measure that counts
        for w in workers:
            w.stop_soon()
        for w in workers:
            if w.finish() != 0:
                ledger.violations.append(f"producer {w.run} rank {w.rank} exited with {w.proc.returncode}")
        peak_sampled = sampler.close()
        sampler = None
        d.memory()
        ledger.check(workers, "load")
        if ledger.failed:
            ledger.violations.append(f"{ledger.failed} commit(s) failed under load: {ledger.failures}")
        _stop(d, ledger)
        _check_rss(d, ledger)
    finally:
        if sampler is not None:
            sampler.close()
        _kill_all(workers)
        d.cleanup()
    return {
        "producers": len(workers), "runs": runs, "world_size": world, "seconds": seconds,
        "commits_acked": ledger.acked, "commits_failed": ledger.failed, "acked_bytes": ledger.acked_bytes,
        "shares_verified": len(ledger.verified), "bytes_lost": ledger.lost_bytes,
        "memory_budget": d.memory_budget, "peak_rss": d.peak_rss, "peak_rss_sampled": peak_sampled,
        "max_queued_bytes_seen": status_max, "latency": _latency(ledger),
        "emit_blocked_p99_s": sorted(ledger.blocked)[int(0.99 * (len(ledger.blocked) - 1))] if ledger.blocked else None,
        "wall_s": time.monotonic() - t0, "violations": ledger.violations,
    }


# -- the report ----------------------------------------------------------------------------------------------
# -- model: the randomized model-based test of the save path, for as long as asked ---------------
def model_soak(base: Path, *, seconds: float, examples: int, steps: int, say: Say = print) -> dict[str, Any]:
    """Run ``tests/test_model.py``'s model (random states, saves and emit blocks under
    random staging, chunk_size, format and reuse; every step loaded back bit-exactly,
    verified, its files read with safetensors/h5py) in rounds of ``examples`` fresh
    random examples of up to ``steps`` steps, until ``seconds`` have passed or one
    fails. A failure is reported as hypothesis shrank it, with its reproduce blob."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(HERE.parent / "tests"))
    import test_model

    os.environ["CKPTD_CONFIG"] = "none"  # the built-in defaults, whatever this machine's config says
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())  # for DTensor pieces
    violations: list[str] = []
    rounds = 0
    t0 = time.monotonic()
    test_model.SaveModel.checked = 0
    try:
        mesh = init_device_mesh("cpu", (1,))
        while time.monotonic() - t0 < seconds and not violations:
            rounds += 1
            try:
                test_model.run_model(base / f"model{rounds}", mesh, examples, steps, seed=None)
            except Exception as exc:  # hypothesis's report of the shrunk failure, stacks and log included
                violations.append(f"model round {rounds}: {_shorten(str(exc)) if len(str(exc)) > 4000 else exc}")
            say(f"  model round {rounds}: {examples} examples, {test_model.SaveModel.checked} steps checked so far, "
                f"{time.monotonic() - t0:.0f} s")
    finally:
        dist.destroy_process_group()
    return {"rounds": rounds, "examples": rounds * examples, "steps_checked": test_model.SaveModel.checked,
            "seconds": time.monotonic() - t0, "shares_verified": test_model.SaveModel.checked, "bytes_lost": 0,
            "peak_rss": 0, "violations": violations}


def summary(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    kill, fuzz, ld, model = results.get("kill"), results.get("fuzz"), results.get("load"), results.get("model")
    parts = [r for r in (kill, fuzz, ld, model) if r]
    return {
        "kills_survived": kill["kills_survived"] if kill else None,
        "malformed_messages_sent": fuzz["malformed"] if fuzz else None,
        "malformed_frames_sent": fuzz["frames"] if fuzz else None,
        "checkpoints_verified": sum(r["shares_verified"] for r in parts),
        "bytes_lost": sum(r["bytes_lost"] for r in parts),
        "peak_daemon_rss": max((r["peak_rss"] for r in parts), default=0),
        "commit_latency_p50_s": ld["latency"]["p50_s"] if ld else None,
        "commit_latency_p99_s": ld["latency"]["p99_s"] if ld else None,
        "violations": sum(len(r["violations"]) for r in parts),
    }


def print_report(results: dict[str, dict[str, Any]], say: Say = print) -> None:
    s = summary(results)
    mib = lambda n: f"{n / MiB:.0f} MiB"  # noqa: E731
    sec = lambda x: "-" if x is None else f"{x * 1000:.0f} ms"  # noqa: E731
    say("")
    say("ckptd stress report")
    if "kill" in results:
        k = results["kill"]
        say(f"  kill -9 of the daemon:  {k['kills_survived']}/{k['kills']} kills survived; {k['producers']} producers; "
            f"{k['commits_acked']} commits acknowledged, {k['commits_failed']} failed and told "
            f"({k['retired_by_retention']} later removed by keep_last); peak RSS {mib(k['peak_rss'])}; "
            f"{k['seconds']:.0f} s")
    if "fuzz" in results:
        f = results["fuzz"]
        say(f"  hostile wire input:     {f['malformed']} malformed messages ({f['frames']} frames in "
            f"{f['messages']} messages) from {f['identities']} identities; {f['error_replies']} error replies; "
            f"daemon peak RSS {mib(f['peak_rss'])} (budget {mib(f['memory_budget'])}); good producer: "
            f"{f['good_commits_acked']} acknowledged, {f['good_commits_failed']} failed; {f['seconds']:.0f} s")
    if "load" in results:
        ld = results["load"]
        lat = ld["latency"]
        say(f"  load:                   {ld['producers']} producers ({ld['runs']} runs x {ld['world_size']} ranks), "
            f"{ld['seconds']:g} s: {ld['commits_acked']} commits acknowledged "
            f"({ld['acked_bytes'] / 1e9:.2f} GB), {ld['commits_failed']} failed; daemon peak RSS "
            f"{mib(ld['peak_rss'])} (budget {mib(ld['memory_budget'])}); commit latency p50 {sec(lat['p50_s'])}, "
            f"p99 {sec(lat['p99_s'])}, max {sec(lat['max_s'])}")
    if "model" in results:
        m = results["model"]
        say(f"  model (save path):      {m['examples']} random examples in {m['rounds']} rounds, {m['steps_checked']} "
            f"steps loaded back bit-exactly, verified and read with safetensors/h5py; {m['seconds']:.0f} s")
    say(f"  kills survived:         {s['kills_survived'] if s['kills_survived'] is not None else '-'}")
    say(f"  malformed frames sent:  {s['malformed_frames_sent'] if s['malformed_frames_sent'] is not None else '-'}"
        f" ({s['malformed_messages_sent'] if s['malformed_messages_sent'] is not None else '-'} messages)")
    say(f"  checkpoints verified:   {s['checkpoints_verified']} (rank shares, bit-exact, checksums checked)")
    say(f"  bytes lost:             {s['bytes_lost']}")
    say(f"  peak daemon RSS:        {mib(s['peak_daemon_rss'])}")
    say(f"  commit latency:         p50 {sec(s['commit_latency_p50_s'])}, p99 {sec(s['commit_latency_p99_s'])}")
    problems = [v for r in results.values() for v in r["violations"]]
    say(f"  violations:             {len(problems) or 'none'}")
    for v in problems[:50]:
        say(f"    - {v}")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    pp = sub.add_parser("producer", help="(internal) one producer process")
    for name, kind in (("endpoint", str), ("run", str), ("rank", int), ("world-size", int), ("out", str),
                       ("sizes", str), ("staging", str), ("timeout", float), ("heartbeat", float),
                       ("emit-timeout", float), ("hang-limit", float), ("transport", str)):
        pp.add_argument(f"--{name}", type=kind, required=True)
    ap.add_argument("--quick", action="store_true",
                    help="small sizes: --kills 5 --frames 5000 --load-seconds 5 --producers 4 --runs 2")
    ap.add_argument("--kills", type=int, default=100, help="kill -9 of the daemon, this many times (100)")
    ap.add_argument("--kill-producers", type=int, default=3, help="producers during the kills (3)")
    ap.add_argument("--frames", type=int, default=100_000, help="malformed messages to send (100000)")
    ap.add_argument("--load-seconds", type=float, default=60.0, help="how long the load runs (60)")
    ap.add_argument("--producers", type=int, default=16, help="producer processes under load (16)")
    ap.add_argument("--runs", type=int, default=4, help="runs they form (4); producers / runs ranks each")
    ap.add_argument("--model-seconds", type=float, default=300.0,
                    help="how long the randomized model of the save path runs (300)")
    ap.add_argument("--model-examples", type=int, default=50, help="model examples per round (50)")
    ap.add_argument("--model-steps", type=int, default=20, help="most steps of one model example (20)")
    ap.add_argument("--only", choices=["kill", "fuzz", "load", "model"], action="append",
                    help="run only this scenario (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, default=None, help="where the temp folder goes (default: the temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the temp folder (configs, logs, records)")
    ap.add_argument("--json", type=Path, default=None, help="write every figure and violation here")
    args = ap.parse_args(argv)
    if args.cmd == "producer":
        return producer_main(args)
    if args.quick:
        args.kills, args.frames, args.load_seconds, args.producers, args.runs = 5, 5000, 5.0, 4, 2
        args.model_seconds, args.model_examples, args.model_steps = 20.0, 5, 8
    for var in _ENV_ISOLATE:
        os.environ.pop(var, None)
    signal.signal(signal.SIGTERM, _interrupt)  # clean up (kill what we started) on SIGTERM too
    base = Path(tempfile.mkdtemp(prefix="ckptd-stress-", dir=args.dir))
    wanted = args.only or ["kill", "fuzz", "load", "model"]
    results: dict[str, dict[str, Any]] = {}
    say = lambda text: print(text, flush=True)  # noqa: E731
    try:
        if "kill" in wanted:
            say(f"kill -9 of the daemon, {args.kills} times, {args.kill_producers} producers ...")
            results["kill"] = kill_loop(base, kills=args.kills, producers=args.kill_producers, seed=args.seed, say=say)
        if "fuzz" in wanted:
            say(f"hostile wire input, {args.frames} malformed messages, beside a good producer ...")
            results["fuzz"] = live_fuzz(base, messages=args.frames, seed=args.seed, say=say)
        if "load" in wanted:
            say(f"load: {args.producers} producers in {args.runs} runs for {args.load_seconds:g} s ...")
            results["load"] = load(base, seconds=args.load_seconds, producers=args.producers, runs=args.runs, say=say)
        if "model" in wanted:
            say(f"model: random saves of random states for {args.model_seconds:g} s, {args.model_examples} "
                "examples a round ...")
            results["model"] = model_soak(base, seconds=args.model_seconds, examples=args.model_examples,
                                          steps=args.model_steps, say=say)
    finally:
        if args.keep:
            say(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    print_report(results, say)
    if args.json:
        args.json.write_text(json.dumps({"summary": summary(results), "results": results,
                                         "argv": sys.argv[1:], "cpus": os.cpu_count()}, indent=1))
    return 1 if any(r["violations"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
