#!/usr/bin/env python3
"""ckptd against its floors and its competitors, measured in one run on the same bytes.

    python benchmarks/bench.py --size 1GiB --tensors 64 --repeat 3 --json out.json

What it measures (see benchmarks/README.md for how to read each figure):

* ckptd, through a real ``ckptd serve`` subprocess: how long ``emit`` blocks the
  caller for every tensor of a step, how long ``save`` blocks, and how long until
  the commit is acknowledged (durable on disk).
* memcpy of the same bytes into preallocated, pre-faulted memory: the floor of
  any snapshot, and what ``emit`` of a CPU tensor is compared against.
* ``torch.save`` + fsync, and one raw sequential write + fsync of the same bytes
  in the same filesystem as the checkpoint root: the floor of durable writing.
* ``torch.distributed.checkpoint.async_save`` (DCP), when it runs here.

Every measurement runs once per repeat, interleaved (memcpy, ckptd, baselines,
memcpy, ckptd, ...), so slow phases of a shared, noisy machine hit all of them
alike; the table reports the median and the minimum. A warm-up round runs
first and is not reported: it pays one-time costs (imports, page faults of
fresh staging, the daemon's first connection) that every steady-state
checkpoint does not.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import ckptd
from ckptd.config import parse_size

GB = 1e9  # throughput in decimal GB/s, as the daemon's own log reports it
RUN = "bench"
# Variables that would make the producer read another config or run id; the
# benchmark configures everything explicitly and must not pick them up.
_ENV_ISOLATE = ("CKPTD_CONFIG", "CKPTD_ENDPOINT", "CKPTD_RUN", "CKPTD_ROOT", "RANK", "WORLD_SIZE")


# -- the synthetic state ------------------------------------------------------------------
def make_state(nbytes: int, ntensors: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``ntensors`` float32 tensors of equal size, ``nbytes`` in all (rounded down to 4 bytes
    per element). Random values, so that nothing on the path can shortcut zeros."""
    numel = max(1, nbytes // (4 * ntensors))
    gen = torch.Generator().manual_seed(seed)
    width = len(str(ntensors - 1))
    return {f"layers.{i:0{width}d}.weight": torch.rand(numel, generator=gen) for i in range(ntensors)}


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# -- samples and their summary ------------------------------------------------------------
@dataclass
class Samples:
    """Seconds per repeat, keyed by measurement; notes for what could not run."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, list[Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, key: str, value: float) -> None:
        self.seconds.setdefault(key, []).append(value)

    def add_extra(self, key: str, value: Any) -> None:
        self.extra.setdefault(key, []).append(value)


def _stats(values: list[float], nbytes: int) -> dict[str, float]:
    med, low = statistics.median(values), min(values)
    return {"median_s": med, "min_s": low, "max_s": max(values),
            "median_gbps": nbytes / med / GB, "best_gbps": nbytes / low / GB}


# -- baselines: memcpy ----------------------------------------------------------------------
class CopyTargets:
    """One preallocated, pre-faulted buffer cut into one destination per tensor, laid out
    back to back like ckptd's staging arena; torch, numpy and raw-pointer views of it."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.flat = torch.empty(state_bytes(state), dtype=torch.uint8)
        self.flat.fill_(1)  # touch every page now: first-touch faults are not memcpy
        self.src = list(state.values())
        self.dst: list[torch.Tensor] = []
        offset = 0
        for t in self.src:
            n = t.numel() * t.element_size()
            self.dst.append(self.flat[offset:offset + n].view(t.dtype))
            offset += n
        self.src_np = [t.numpy() for t in self.src]
        self.dst_np = [t.numpy() for t in self.dst]

    def torch_copy(self) -> None:
        for d, s in zip(self.dst, self.src, strict=True):
            d.copy_(s)

    def numpy_copy(self) -> None:
        for d, s in zip(self.dst_np, self.src_np, strict=True):
            np.copyto(d, s)

    def memmove(self) -> None:
        for d, s in zip(self.dst, self.src, strict=True):
            ctypes.memmove(d.data_ptr(), s.data_ptr(), s.numel() * s.element_size())

    def bytes_view(self) -> memoryview:
        """The copied bytes, for the raw-write baseline (valid after any copy above)."""
        return self.flat.numpy().data.cast("B")


def time_call(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- CPU seconds and page faults: robust where wall time is noise --------------------------------
# On a shared machine, wall times swing with other tenants; CPU seconds and page
# faults per checkpoint do not, and they say where the work goes.
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _task_stat(path: str) -> tuple[str, float, int]:
    """(comm, utime+stime seconds, minor faults) of one /proc task or process."""
    with open(path) as f:
        text = f.read()
    comm = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return comm, (int(fields[11]) + int(fields[12])) / _TICK, int(fields[7])


def cpu_by_thread(pid: int, names: dict[int, str] | None = None, rest: str = "other") -> dict[str, float]:
    """CPU seconds of every thread of ``pid`` so far, grouped: Python threads by name where
    ``names`` (native id -> name) knows them, libzmq's I/O threads as "zmq_io", the rest
    (torch's intra-op workers here; the daemon's Python threads, whose names another
    process cannot see) as ``rest``."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            comm, cpu, _ = _task_stat(f"/proc/{pid}/task/{tid}/stat")
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        group = (names or {}).get(int(tid)) or ("zmq_io" if comm.startswith("ZMQbg/IO") else rest)
        out[group] = out.get(group, 0.0) + cpu
    return out


def minor_faults(pid: int) -> int:
    try:
        return _task_stat(f"/proc/{pid}/stat")[2]
    except (OSError, ValueError):
        return 0


def own_thread_names() -> dict[int, str]:
    """The ckptd producer's threads and the caller's; others (DCP's executor) count as "other"."""
    return {t.native_id: t.name for t in threading.enumerate()
            if t.native_id is not None and (t.name == "MainThread" or t.name.startswith("ckptd-"))}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 4) for k, v in after.items() if v - before.get(k, 0.0) >= 0}


def own_cpu() -> float:
    """This process's CPU seconds, all threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure_memcpy(targets: CopyTargets, samples: Samples | None) -> None:
    """The three ways to copy; the fastest per repeat is "memcpy", the floor of emit."""
    times = {"memcpy.torch_copy": time_call(targets.torch_copy),
             "memcpy.numpy_copyto": time_call(targets.numpy_copy),
             "memcpy.ctypes_memmove": time_call(targets.memmove)}
    if samples is not None:
        for key, value in times.items():
            samples.add(key, value)
        samples.add("memcpy", min(times.values()))


# -- baselines: durable writes --------------------------------------------------------------
def raw_write_fsync(data: memoryview, path: Path, block: int) -> float:
    """One file, sequential os.write of ``block`` bytes at a time, then fsync: the disk's floor."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for start in range(0, len(data), block):
            view = data[start:start + block]
            while view:  # regular files may write short
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def torch_save_fsync(state: dict[str, torch.Tensor], path: Path) -> float:
    """torch.save blocks the caller until the bytes are in the page cache; fsync makes them
    durable, which is what a ckptd commit promises."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


# -- baseline: torch.distributed.checkpoint.async_save ------------------------------------------
class DcpBench:
    """DCP's async_save in this process, without a process group (DCP then assumes one
    process). Two variants: the default writer, which stages into fresh memory each
    call, and a reused DefaultStager, which keeps its staging memory like ckptd's arena."""

    def __init__(self, base: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
        self.dcp = dcp
        self.base = base
        # pinned memory, shared memory, async staging and non-blocking copies all need CUDA
        self.stager = DefaultStager(StagingOptions(False, False, False, False))
        self.count = 0

    def once(self, state: dict[str, torch.Tensor], reuse_stager: bool) -> tuple[float, float]:
        """-> (seconds async_save blocked the caller, seconds until its future resolved)."""
        from torch.distributed.checkpoint import FileSystemWriter

        self.count += 1
        out = self.base / f"dcp-{self.count}"
        t0 = time.perf_counter()
        response = self.dcp.async_save(state, storage_writer=FileSystemWriter(out),
                                       async_stager=self.stager if reuse_stager else None)
        t1 = time.perf_counter()
        # a Future, or (with a stager that stages asynchronously) an AsyncSaveResponse
        done: Any = getattr(response, "upload_completion", response)
        done.result()
        t2 = time.perf_counter()
        shutil.rmtree(out, ignore_errors=True)
        return t1 - t0, t2 - t0

    def close(self) -> None:
        self.stager.close()


# -- ckptd: the daemon subprocess ---------------------------------------------------------------
class DaemonProcess:
    """``python -m ckptd serve`` with its own config, root and a short ipc socket path.
    Always stopped and cleaned up by ``close`` (SIGTERM, then SIGKILL)."""

    def __init__(self, base: Path, chunk_size: str | None, log_level: str = "info", *,
                 nice: int = 0, extra_env: dict[str, str] | None = None) -> None:
        self.root = base / "ckpt"
        self.nice = nice
        self.extra_env = extra_env or {}
        # sun_path holds 107 bytes: the socket lives in a short folder of its own under /tmp
        self.sock_dir = Path(tempfile.mkdtemp(prefix="ckb", dir="/tmp"))
        self.sock = self.sock_dir / "d.sock"
        self.endpoint = f"ipc://{self.sock}"
        keys = {"endpoint": self.endpoint, "root": str(self.root), "log_level": log_level}
        if chunk_size is not None:  # otherwise the daemon's own default applies
            keys["chunk_size"] = chunk_size
        self.config = base / "daemon.toml"
        self.config.write_text("[daemon]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))
        self.log = base / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _ENV_ISOLATE}
        env.update(self.extra_env, PYTHONUNBUFFERED="1")
        nice = self.nice
        with open(self.log, "ab") as log:
            # a niced daemon shows what emit costs when the writer yields the CPU to training
            self.proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "-c", str(self.config)],
                                         stdout=log, stderr=subprocess.STDOUT, env=env,
                                         preexec_fn=(lambda: os.nice(nice)) if nice else None)
        deadline = time.monotonic() + timeout
        while not self.sock.exists():  # bound only after the root is locked and cleaned
            if self.proc.poll() is not None:
                raise RuntimeError(f"ckptd daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"ckptd daemon not ready after {timeout} s:\n{self.log_tail()}")
            time.sleep(0.02)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def commit_seconds(self) -> dict[int, float]:
        """step -> seconds the daemon itself took, first byte received to manifest durable
        (its ``committed ... seconds=`` log line)."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return {int(m[1]): float(m[2]) for m in re.finditer(r"committed run=\S+ step=(\d+) .*?seconds=([\d.]+)", text)}

    def problems(self) -> list[str]:
        """Warnings, errors and tracebacks the daemon logged: a benchmark of a failing
        daemon is no benchmark."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return [line for line in text.splitlines() if re.match(r"(WARNING|ERROR|CRITICAL|Traceback)", line)]

    def close(self) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)  # drains and exits 0
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            shutil.rmtree(self.sock_dir, ignore_errors=True)


class PySpy:
    """Optional: ``py-spy record`` attached to the daemon, written when the daemon exits."""

    def __init__(self, pid: int, out: Path, idle: bool) -> None:
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        fmt = {".svg": "flamegraph", ".json": "speedscope"}.get(out.suffix, "raw")
        cmd = [exe, "record", "--pid", str(pid), "--output", str(out), "--format", fmt,
               "--rate", "200", "--threads", "--nonblocking"] + (["--idle"] if idle else [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)  # let it attach before the measured work starts

    def wait(self) -> None:
        try:
            self.proc.wait(30)  # py-spy writes its output and exits when the target exits
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(30)


# -- ckptd: one checkpoint ------------------------------------------------------------------
@dataclass
class CkptdRun:
    """One ckptd checkpoint as the caller saw it."""

    step: int
    blocked_s: float  # time the caller was inside ckptd calls before it could go on
    commit_s: float  # first call into ckptd until the commit was acknowledged (durable)
    staging_wait_s: float  # part of blocked_s spent waiting for staging space


def _staging_waited(p: ckptd.Producer) -> float:
    arena = getattr(p, "_arena", None)  # internal; only a diagnostic, so tolerate its absence
    return float(getattr(arena, "blocked_s", 0.0))


def ckptd_emit(p: ckptd.Producer, state: dict[str, torch.Tensor], step: int, timeout: float) -> CkptdRun:
    """Every tensor through ``emit`` inside ``with p.checkpoint(step)``; blocking time is
    the sum of the emit calls (the loop around them is the caller's own work)."""
    waited0 = _staging_waited(p)
    blocked = 0.0
    t0 = time.perf_counter()
    with p.checkpoint(step) as handle:
        for name, tensor in state.items():
            a = time.perf_counter()
            p.emit(name, tensor)
            blocked += time.perf_counter() - a
    handle.wait(timeout)
    done = time.perf_counter()
    return CkptdRun(step, blocked, done - t0, _staging_waited(p) - waited0)


def ckptd_save(p: ckptd.Producer, state: dict[str, torch.Tensor], step: int, timeout: float) -> CkptdRun:
    """The whole state in one ``save`` call (it also sends the commit)."""
    waited0 = _staging_waited(p)
    t0 = time.perf_counter()
    handle = p.save(state, step)
    t1 = time.perf_counter()
    handle.wait(timeout)
    done = time.perf_counter()
    return CkptdRun(step, t1 - t0, done - t0, _staging_waited(p) - waited0)


def remove_step(root: Path, step: int) -> None:
    """Keep the disk footprint at one checkpoint: the bench needs its bytes written, not kept."""
    shutil.rmtree(root / RUN / f"step-{step:012d}", ignore_errors=True)


# -- the run ---------------------------------------------------------------------------------
@dataclass
class Bench:
    args: argparse.Namespace
    base: Path
    state: dict[str, torch.Tensor]
    daemon: DaemonProcess
    producer: ckptd.Producer
    targets: CopyTargets
    dcp: DcpBench | None
    samples: Samples = field(default_factory=Samples)
    step: int = 0
    rounds: int = 0
    steps: dict[str, list[int]] = field(default_factory=dict)

    def next_step(self, kind: str, record: bool) -> int:
        self.step += 1
        if record:
            self.steps.setdefault(kind, []).append(self.step)
        return self.step

    def quiet_disk(self) -> None:
        """Start each durable write from a disk with nothing else to flush (the deletes of the
        previous measurement leave journal work behind)."""
        os.sync()

    def round(self, record: bool) -> None:
        """One repeat of every measurement; ``record=False`` is the warm-up."""
        s = self.samples if record else None
        nbytes = state_bytes(self.state)
        if s is not None:
            s.add_extra("loadavg_1min", os.getloadavg()[0])  # how busy the rest of the machine is
        measure_memcpy(self.targets, s)
        # Alternate which ckptd call goes first: the first one after the baselines finds
        # the daemon idle for seconds (its freed buffers handed back to the OS), which
        # would bias one of the two.
        ckptd_calls = [("emit", ckptd_emit), ("save", ckptd_save)]
        if self.rounds % 2:
            ckptd_calls.reverse()
        self.rounds += 1
        for kind, fn in ckptd_calls:
            self.run_ckptd(kind, fn, record)
        self.run_disk_baselines(s, nbytes)
        self.run_dcp(s)

    def run_disk_baselines(self, s: Samples | None, nbytes: int) -> None:
        """torch.save + fsync and the raw write + fsync, each file deleted once measured."""
        results: dict[str, tuple[float, float]] = {}
        for key, path, write in (
            ("torch_save_fsync", self.base / "baseline.pt", lambda p: torch_save_fsync(self.state, p)),
            ("raw_write_fsync", self.base / "baseline.raw",
             lambda p: raw_write_fsync(self.targets.bytes_view(), p, self.args.block)),
        ):
            self.quiet_disk()
            cpu = own_cpu()
            seconds = write(path)
            results[key] = (seconds, own_cpu() - cpu)
            path.unlink()
        if s is None:
            return
        for key, (seconds, cpu) in results.items():
            s.add(key, seconds)
            s.add_extra(f"{key}.cpu_s", cpu)
        # the same repeat's two figures: cancels a slow phase of the disk that hits both
        s.add_extra("ratio.commit_vs_raw", results["raw_write_fsync"][0] / s.seconds["ckptd.emit.commit"][-1])

    def run_ckptd(self, kind: str, fn: Callable[..., CkptdRun], record: bool) -> None:
        self.quiet_disk()
        step = self.next_step(kind, record)
        names = own_thread_names()
        pid = self.daemon.pid
        d_cpu, p_cpu, faults = cpu_by_thread(pid, rest="python"), cpu_by_thread(os.getpid(), names), minor_faults(pid)
        run = fn(self.producer, self.state, step, self.args.timeout)
        d_cpu = _delta(cpu_by_thread(pid, rest="python"), d_cpu)
        p_cpu = _delta(cpu_by_thread(os.getpid(), names), p_cpu)
        faults = minor_faults(self.daemon.pid) - faults
        remove_step(self.daemon.root, step)
        if record:
            self.samples.add(f"ckptd.{kind}.blocking", run.blocked_s)
            self.samples.add(f"ckptd.{kind}.commit", run.commit_s)
            self.samples.add_extra(f"ckptd.{kind}.staging_wait_s", run.staging_wait_s)
            self.samples.add_extra(f"ckptd.{kind}.daemon_cpu_s", d_cpu)
            self.samples.add_extra(f"ckptd.{kind}.producer_cpu_s", p_cpu)
            self.samples.add_extra(f"ckptd.{kind}.daemon_minor_faults", faults)

    def run_dcp(self, s: Samples | None) -> None:
        if self.dcp is None:
            return
        for label, reuse in (("dcp_async_save.fresh_staging", False), ("dcp_async_save.reused_stager", True)):
            self.quiet_disk()
            try:
                blocked, total = self.dcp.once(self.state, reuse)
            except Exception as exc:  # a baseline that cannot run here is a note, not a failure
                self.samples.notes.append(f"{label} failed: {type(exc).__name__}: {exc}")
                self.dcp.close()
                self.dcp = None
                return
            if s is not None:
                s.add(f"{label}.blocking", blocked)
                s.add(f"{label}.done", total)


def try_dcp(base: Path, samples: Samples) -> DcpBench | None:
    try:
        return DcpBench(base)
    except Exception as exc:
        samples.notes.append(f"torch.distributed.checkpoint unavailable: {type(exc).__name__}: {exc}")
        return None


# -- report ----------------------------------------------------------------------------------
ROWS = [  # key, label; rows without samples are left out
    ("memcpy.torch_copy", "memcpy: torch dst.copy_(src)"),
    ("memcpy.numpy_copyto", "memcpy: numpy copyto"),
    ("memcpy.ctypes_memmove", "memcpy: ctypes.memmove"),
    ("memcpy", "memcpy (fastest of the three, per repeat)"),
    ("ckptd.emit.blocking", "ckptd emit: caller blocked (sum of emits)"),
    ("ckptd.emit.commit", "ckptd emit: first emit -> commit acked"),
    ("ckptd.save.blocking", "ckptd save: caller blocked"),
    ("ckptd.save.commit", "ckptd save: call -> commit acked"),
    ("ckptd.daemon.emit", "ckptd daemon: 1st byte -> manifest (emit)"),
    ("ckptd.daemon.save", "ckptd daemon: 1st byte -> manifest (save)"),
    ("torch_save_fsync", "torch.save + fsync (blocking)"),
    ("raw_write_fsync", "raw write + fsync (one file)"),
    ("dcp_async_save.fresh_staging.blocking", "DCP async_save, default: blocked"),
    ("dcp_async_save.fresh_staging.done", "DCP async_save, default: -> done"),
    ("dcp_async_save.reused_stager.blocking", "DCP async_save, reused stager: blocked"),
    ("dcp_async_save.reused_stager.done", "DCP async_save, reused stager: -> done"),
]


def summarize(samples: Samples, nbytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """-> (per-measurement stats, the project's ratios with their targets)."""
    stats = {k: _stats(v, nbytes) for k, v in samples.seconds.items()}

    def ratio(a: str, b: str, use: str = "median_s") -> float | None:
        return stats[a][use] / stats[b][use] if a in stats and b in stats else None

    ratios: dict[str, Any] = {
        "emit_blocking_over_memcpy": {"median": ratio("ckptd.emit.blocking", "memcpy"),
                                      "min": ratio("ckptd.emit.blocking", "memcpy", "min_s"),
                                      "target": "<= 1.5"},
        "save_blocking_over_memcpy": {"median": ratio("ckptd.save.blocking", "memcpy"),
                                      "min": ratio("ckptd.save.blocking", "memcpy", "min_s"),
                                      "target": "<= 1.5"},
        # throughput ratio = inverse time ratio
        "commit_gbps_over_raw_write_gbps": {"median": ratio("raw_write_fsync", "ckptd.emit.commit"),
                                            "min": ratio("raw_write_fsync", "ckptd.emit.commit", "min_s"),
                                            "paired_median": _median_or_none(samples.extra.get("ratio.commit_vs_raw")),
                                            "target": ">= 0.8"},
        "torch_save_blocking_over_emit_blocking": {"median": ratio("torch_save_fsync", "ckptd.emit.blocking"),
                                                   "min": ratio("torch_save_fsync", "ckptd.emit.blocking", "min_s")},
        "dcp_reused_blocking_over_emit_blocking": {
            "median": ratio("dcp_async_save.reused_stager.blocking", "ckptd.emit.blocking"),
            "min": ratio("dcp_async_save.reused_stager.blocking", "ckptd.emit.blocking", "min_s")},
    }
    return stats, ratios


def _median_or_none(values: list[float] | None) -> float | None:
    return statistics.median(values) if values else None


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(stats: dict[str, Any], ratios: dict[str, Any], nbytes: int, ntensors: int,
                repeats: int, notes: list[str]) -> None:
    print(f"\n{nbytes / 2**30:.3f} GiB ({nbytes} bytes) in {ntensors} float32 tensors, "
          f"{repeats} repeat(s); GB/s = 1e9 bytes/s\n")
    print(f"{'measurement':<44} {'median s':>9} {'min s':>9} {'GB/s med':>9} {'GB/s best':>9}")
    for key, label in ROWS:
        if key in stats:
            st = stats[key]
            print(f"{label:<44} {st['median_s']:>9.3f} {st['min_s']:>9.3f} "
                  f"{st['median_gbps']:>9.2f} {st['best_gbps']:>9.2f}")
    print(f"\n{'ratio':<44} {'median':>9} {'min':>9}  target")
    for key, r in ratios.items():
        extra = f"  (paired per repeat: {_fmt(r['paired_median'])})" if r.get("paired_median") else ""
        print(f"{key:<44} {_fmt(r['median']):>9} {_fmt(r['min']):>9}  {_verdict(r)}{extra}")
    for note in notes:
        print(f"note: {note}")


def cpu_summary(extra: dict[str, list[Any]]) -> dict[str, dict[str, float]]:
    """Median CPU seconds (and daemon page faults) per checkpoint, by process and thread."""
    out: dict[str, dict[str, float]] = {}
    for kind in ("emit", "save"):
        row: dict[str, float] = {}
        for proc in ("producer", "daemon"):
            per_repeat = extra.get(f"ckptd.{kind}.{proc}_cpu_s", [])
            for group in sorted({g for d in per_repeat for g in d}):
                row[f"{proc} {group}"] = statistics.median(d.get(group, 0.0) for d in per_repeat)
            if per_repeat:
                row[f"{proc} total"] = statistics.median(sum(d.values()) for d in per_repeat)
        faults = extra.get(f"ckptd.{kind}.daemon_minor_faults")
        if faults:
            row["daemon minor faults"] = statistics.median(faults)
        out[kind] = row
    for key in ("raw_write_fsync", "torch_save_fsync"):
        if extra.get(f"{key}.cpu_s"):
            out[key] = {"process total": statistics.median(extra[f"{key}.cpu_s"])}
    return out


_CPU_LABELS = {  # row key -> what the thread does
    "producer MainThread": "the caller's emit/save calls",
    "producer other": "torch intra-op workers of the copy, etc.",
    "producer ckptd-sender": "ships staged tensors",
    "producer zmq_io": "libzmq: socket writes",
    "daemon python": "main loop, writer, syncer",
    "daemon zmq_io": "libzmq: socket reads",
}


def print_cpu(cpu: dict[str, dict[str, float]], nbytes: int, loads: list[float]) -> None:
    kinds = [k for k in ("emit", "save") if k in cpu]
    rows = sorted({key for k in kinds for key in cpu[k]}, key=lambda r: (r.startswith("daemon"), "total" in r, r))
    print(f"\n{'CPU s per ckptd checkpoint (median)':<58}" + "".join(f"{k:>9}" for k in kinds))
    for row in rows:
        values = [cpu[k].get(row) for k in kinds]
        if row == "daemon minor faults":  # 4 KiB pages: freshly mapped memory the daemon touched
            label, cells = "daemon page faults, x state size (fresh memory)", [
                "-" if v is None else f"{v * 4096 / nbytes:.2f}" for v in values]
        else:
            label = f"{row}: {_CPU_LABELS[row]}" if row in _CPU_LABELS else row
            cells = [_fmt(v, ".2f") for v in values]
        print(f"  {label:<56}" + "".join(f"{c:>9}" for c in cells))
    base = [f"{name} {cpu[key]['process total']:.2f}" for key, name in
            (("raw_write_fsync", "raw write+fsync"), ("torch_save_fsync", "torch.save+fsync")) if key in cpu]
    if base:
        print(f"  baselines, CPU s of the whole process: {', '.join(base)}")
    if loads:
        print(f"load average (1 min) at each repeat: {', '.join(f'{x:.1f}' for x in loads)} "
              f"on {os.cpu_count()} CPUs (other tenants make wall times noisy)")


def _verdict(r: dict[str, Any]) -> str:
    target, value = r.get("target"), r.get("median")
    if target is None or value is None:
        return ""
    limit = float(target.split()[1])
    ok = value <= limit if target.startswith("<=") else value >= limit
    return f"{target} {'ok' if ok else 'MISSED'}"


# -- setup and teardown -------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="total bytes of the state (default 1GiB)")
    ap.add_argument("--tensors", type=int, default=64, help="number of float32 tensors (default 64)")
    ap.add_argument("--repeat", type=int, default=5, help="measured repeats after one warm-up (default 5)")
    ap.add_argument("--json", type=Path, help="write every raw number here")
    ap.add_argument("--dir", type=Path, default=None,
                    help="parent of the temp folder holding the checkpoint root and baseline files "
                         "(default: the system temp dir); all disk baselines use this filesystem")
    ap.add_argument("--chunk-size", default=None, help="daemon chunk_size (default: the daemon's default)")
    ap.add_argument("--staging", default=None, help="producer staging_size (default: state size + slack)")
    ap.add_argument("--block", default="64MiB", help="os.write block size of the raw baseline (default 64MiB)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for one commit")
    ap.add_argument("--daemon-nice", type=int, default=0,
                    help="start the daemon at this nice value (what-if: a writer that yields the CPU)")
    ap.add_argument("--daemon-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for the daemon, e.g. MALLOC_ARENA_MAX=1 (repeatable)")
    ap.add_argument("--no-dcp", action="store_true", help="skip the torch.distributed.checkpoint baseline")
    ap.add_argument("--py-spy", type=Path, default=None,
                    help="profile the daemon with py-spy into this file (.svg flamegraph, .json speedscope, "
                         "else raw collapsed stacks)")
    ap.add_argument("--py-spy-idle", action="store_true", help="include idle (waiting) samples in the profile")
    ap.add_argument("--keep", action="store_true", help="keep the temp folder (daemon log, config)")
    args = ap.parse_args(argv)
    args.size_bytes = parse_size(args.size)
    args.block = parse_size(args.block)
    if args.tensors < 1 or args.repeat < 1 or args.size_bytes < 4 * args.tensors:
        ap.error("need --tensors >= 1, --repeat >= 1 and at least 4 bytes per tensor")
    if any("=" not in kv for kv in args.daemon_env):
        ap.error("--daemon-env takes KEY=VALUE")
    args.daemon_env = dict(kv.split("=", 1) for kv in args.daemon_env)
    return args


def check_disk(base: Path, nbytes: int) -> None:
    """At most one checkpoint or baseline file exists at a time, but DCP and the page cache
    want headroom: refuse to start with less than twice the state free."""
    free = shutil.disk_usage(base).free
    if free < 2 * nbytes + 2**30:
        raise SystemExit(f"only {free / 2**30:.1f} GiB free under {base}; "
                         f"need {(2 * nbytes + 2**30) / 2**30:.1f} GiB (use --dir elsewhere or a smaller --size)")


def environment(args: argparse.Namespace, base: Path, nbytes: int) -> dict[str, Any]:
    """What the numbers depend on, saved with them."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        commit = ""
    fs = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        fs = subprocess.run(["df", "-T", str(base)], capture_output=True, text=True).stdout.splitlines()[-1]
    return {"size_bytes": nbytes, "tensors": args.tensors, "repeat": args.repeat,
            "chunk_size": args.chunk_size, "staging": args.staging, "block": args.block,
            "daemon_nice": args.daemon_nice, "daemon_env": args.daemon_env,
            "dir": str(base), "df": fs, "git_commit": commit, "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "platform": platform.platform(), "time": time.time()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    for var in _ENV_ISOLATE:
        os.environ.pop(var, None)
    base = Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir=args.dir)).resolve()
    parts = Parts()
    clean = False
    try:
        print(f"building a {args.size_bytes / 2**30:.2f} GiB state in {args.tensors} tensors under {base} ...",
              flush=True)
        check_disk(base, args.size_bytes)
        state = make_state(args.size_bytes, args.tensors)
        nbytes = state_bytes(state)
        targets = CopyTargets(state)
        parts.daemon = daemon = DaemonProcess(base, args.chunk_size, nice=args.daemon_nice,
                                              extra_env=args.daemon_env)
        daemon.start()
        staging = args.staging or nbytes + 64 * len(state) + 2**20  # regions are 64-byte aligned
        parts.producer = producer = ckptd.Producer(daemon.endpoint, RUN, staging_size=staging, timeout=30)
        samples = Samples()
        dcp = None if args.no_dcp else try_dcp(base, samples)
        parts.bench = bench = Bench(args, base, state, daemon, producer, targets, dcp, samples)
        print("warm-up round ...", flush=True)
        bench.round(record=False)
        if args.py_spy is not None:
            parts.spy = PySpy(daemon.pid, args.py_spy.resolve(), args.py_spy_idle)
        for i in range(args.repeat):
            print(f"repeat {i + 1}/{args.repeat} ...", flush=True)
            bench.round(record=True)
        result = finish(args, base, bench, nbytes)
        clean = True
        return result
    finally:
        try:
            parts.teardown(clean)
            if parts.spy is not None:
                print(f"daemon profile: {args.py_spy}")
        finally:
            if args.keep:
                print(f"kept {base}")
            else:
                shutil.rmtree(base, ignore_errors=True)


@dataclass
class Parts:
    """What ``run`` started, so that teardown stops exactly that, in a safe order."""

    daemon: DaemonProcess | None = None
    producer: ckptd.Producer | None = None
    bench: Bench | None = None
    spy: PySpy | None = None

    def teardown(self, clean: bool) -> None:
        """After a clean run the producer says bye first. After a failure the daemon stops
        first: a producer closed while a commit is pending would wait for it, and with the
        daemon gone it gives up after its timeout instead of waiting forever."""
        try:
            if clean and self.producer is not None:
                self.producer.close()
        finally:
            if self.bench is not None and self.bench.dcp is not None:
                self.bench.dcp.close()
            if self.daemon is not None:
                if not clean:
                    print(f"daemon log (last lines):\n{self.daemon.log_tail(20)}", file=sys.stderr)
                self.daemon.close()
            if self.spy is not None:
                self.spy.wait()
            if not clean and self.producer is not None:
                with contextlib.suppress(Exception):
                    self.producer.close()


def finish(args: argparse.Namespace, base: Path, bench: Bench, nbytes: int) -> dict[str, Any]:
    """Fold in the daemon's own timings, print the table, return everything for --json."""
    samples = bench.samples
    samples.notes += [f"daemon log: {line}" for line in bench.daemon.problems()[:10]]
    daemon_secs = bench.daemon.commit_seconds()
    for kind in ("emit", "save"):
        for step in bench.steps.get(kind, []):
            if step in daemon_secs:
                samples.add(f"ckptd.daemon.{kind}", daemon_secs[step])
    stats, ratios = summarize(samples, nbytes)
    cpu = cpu_summary(samples.extra)
    print_table(stats, ratios, nbytes, len(bench.state), args.repeat, samples.notes)
    print_cpu(cpu, nbytes, samples.extra.get("loadavg_1min", []))
    return {"config": environment(args, base, nbytes), "samples_s": samples.seconds, "extra": samples.extra,
            "stats": stats, "ratios": ratios, "cpu": cpu, "notes": samples.notes}


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: daemon stopped, temp removed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    result = run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"raw numbers: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
