"""How close ckptd comes to the machine's limits (docs/performance.md), in one run.

    .venv/bin/python benchmarks/limits.py                         # 1 GiB in 64 tensors + 10,000 small, 5 repeats
    .venv/bin/python benchmarks/limits.py --size 256MiB --repeat 3  # a dev run (~1 min)
    .venv/bin/python benchmarks/bench.py --limits ...             # the same, through bench.py

Every figure is set against a floor or peer measured in the same repeat, on the
same bytes, and the table gives the median of those paired ratios next to its
goal:

1. the stall: ``save`` and ``emit`` blocked against a memcpy of the same tensors
   into warm, preallocated memory (the fastest of a per-tensor ``copy_``, a
   per-tensor ``memmove`` and ``torch._foreach_copy_``), for 64 large tensors and
   for 10,000 small ones;
2. the write path: durable (commit acknowledged) against an O_DIRECT write + fsync
   of the same bytes (and of the new file's folder), on the disk under ``--dir``; and on a RAM disk (``--ramdisk``,
   tmpfs), the daemon's GB/s for each ``[daemon] writer_threads`` in
   ``--writer-threads``, next to a buffered write of the same bytes there;
3. HDF5: durable against naive h5py (a ``create_dataset`` per tensor, fsync) and
   against O_DIRECT; its blocked time against the chunk format's;
4. resume: ``ckptd.load`` warm (page cache) and cold (each file's pages dropped with
   ``posix_fadvise(DONTNEED)``) against a ``preadv`` of the same files into
   preallocated memory, and against ``torch.load`` of the same tensors (``torch.save``d once); ``load(out=...)`` (into the tensors of an allocated state)
   and ``load(mmap=True)`` (tensors mapped from the chunk files, then every byte
   read once); ``load(names=[one])`` cold against a plain read of the same byte
   range, in bytes read from the disk (``/proc/self/io``) and in time;
6. the first save of a job (``--first-save``, on by default), in a fresh process
   each repeat: a new producer with ``staging_size = "auto"`` saves the same large
   state four times; the first save's
   blocked and durable times against the median of the third and fourth saves',
   made once staging has grown (the wait for it is reported, standing for the
   training steps between checkpoints; the second save comes right after the
   first, and is reported on its own). Twice: with no hint (staging starts at
   32 MiB), and with ``Producer(expected_bytes=)`` (staging made at that size in the
   background; the save starts once ``stats()`` shows it made, standing for the
   training steps before a first checkpoint, whose length is reported);
5. what changed: a LoRA-style state (the large state as a frozen base, plus an
   adapter of ``--adapter``, 5%, of the bytes that changes every step) saved with
   ``frozen=["base.*"]`` and saved plain (the daemon recognises the unchanged
   base), against the same state saved whole by a daemon with
   ``reuse_unchanged = false``: bytes the daemon wrote (``/proc/PID/io``) per byte
   of the state, and durable time against the whole save's.

The producer is this process (its stall is what is measured); the daemons are
real ``ckptd serve`` subprocesses (benchmarks/daemons.py), each with its own
root, stopped and removed at the end. Figures a ckptd lacks (an older commit: no
``writer_threads``, no ``out=``, no ``mmap=``) are reported as such.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import torch  # noqa: E402

import baselines  # noqa: E402
from daemons import ENV_ISOLATE, DaemonProcess  # noqa: E402

MiB = 2**20
RUN = "limits"


def parse_size(text: str) -> int:
    from ckptd.config import parse_size as ps

    return ps(text)


# -- the states ---------------------------------------------------------------------------
def make_states(size: int, ntensors: int, small_size: int, nsmall: int) -> dict[str, dict[str, torch.Tensor]]:
    """Random float32 values (nothing can shortcut zeros): ``large`` is ``size`` bytes in
    ``ntensors`` tensors, ``small`` is ``small_size`` bytes in ``nsmall`` tensors, named
    like an optimizer state."""
    gen = torch.Generator().manual_seed(0)
    large = {f"layers.{i:03d}.weight": torch.rand(max(1, size // (4 * ntensors)), generator=gen)
             for i in range(ntensors)}
    small = {f"optim.state.{i}.exp_avg": torch.rand(max(1, small_size // (4 * nsmall)), generator=gen)
             for i in range(nsmall)}
    return {"large": large, "small": small}


def nbytes_of(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class Targets:
    """Preallocated, pre-faulted destinations for every tensor of a state (the memcpy floor)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.src = list(state.values())
        # random, not constant: a host that merges identical pages (KSM) would turn the
        # copy's first write to each page into a copy-on-write fault
        self.dst = [torch.rand_like(t) for t in self.src]

    def fastest_cpu(self) -> float:
        """The same, in CPU seconds of this thread (what a busy machine's wall time hides)."""
        def timed(fn: Callable[[], None]) -> float:
            t0 = time.thread_time()
            fn()
            return time.thread_time() - t0

        return min(timed(lambda: torch._foreach_copy_(self.dst, self.src)),
                   timed(lambda: [d.copy_(s) for d, s in zip(self.dst, self.src)]))

    def fastest(self) -> float:
        def loop_copy() -> None:
            for d, s in zip(self.dst, self.src):
                d.copy_(s)

        def loop_memmove() -> None:
            for d, s in zip(self.dst, self.src):
                ctypes.memmove(d.data_ptr(), s.data_ptr(), s.numel() * s.element_size())

        def foreach() -> None:
            torch._foreach_copy_(self.dst, self.src)

        return min(baselines.time_call(f) for f in (loop_copy, loop_memmove, foreach))


# -- ckptd --------------------------------------------------------------------------------
def producer_for(daemon: DaemonProcess, staging: int, fmt: str | None = None) -> Any:
    import ckptd

    return ckptd.Producer(daemon.endpoint, RUN, rank=0, world_size=1, transport="shm",
                          staging_size=staging, format=fmt, timeout=60)


CPU: dict[str, float] = {}  # the last call's CPU seconds on the calling thread


def time_save(p: Any, state: dict[str, torch.Tensor], step: int, timeout: float) -> tuple[float, float]:
    c0 = time.thread_time()
    t0 = time.perf_counter()
    handle = p.save(state, step)
    t1 = time.perf_counter()
    CPU["blocked"] = time.thread_time() - c0
    handle.wait(timeout)
    return t1 - t0, time.perf_counter() - t0


def time_emit(p: Any, state: dict[str, torch.Tensor], step: int, timeout: float) -> tuple[float, float]:
    blocked = cpu = 0.0
    t0 = time.perf_counter()
    with p.checkpoint(step) as handle:
        for name, t in state.items():
            a, c = time.perf_counter(), time.thread_time()
            p.emit(name, t)
            blocked += time.perf_counter() - a
            cpu += time.thread_time() - c
    CPU["blocked"] = cpu
    handle.wait(timeout)
    return blocked, time.perf_counter() - t0


def time_emit_many(p: Any, state: dict[str, torch.Tensor], step: int, timeout: float) -> tuple[float, float]:
    t0 = time.perf_counter()
    with p.checkpoint(step) as handle:
        a, c = time.perf_counter(), time.thread_time()
        p.emit_many(state)
        blocked = time.perf_counter() - a
        CPU["blocked"] = time.thread_time() - c
    handle.wait(timeout)
    return blocked, time.perf_counter() - t0


def direct_floor(data: memoryview, path: Path, block: int) -> float:
    """Part 2's floor: ``data`` written to a new file with O_DIRECT and fsynced, then its
    folder fsynced, without which the file's name is not durable (ckptd's commit fsyncs
    its step folder and those above it)."""
    took = baselines.raw_write_direct(data, path, block)
    t0 = time.perf_counter()
    baselines.fsync_path(path.parent)
    return took + time.perf_counter() - t0


def step_files(root: Path, step: int) -> list[Path]:
    folder = root / RUN / f"step-{step:012d}"
    return sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".h5"))


def drop_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_LIBC = ctypes.CDLL(None)


def fresh_memory() -> None:
    """Give the allocator's freed memory back to the system (glibc's ``malloc_trim``), so
    the next load faults fresh pages as a new process would, rather than reusing the
    pages the previous load faulted: reading 512 MiB into reused pages took 0.11 s here,
    into fresh ones 0.53 s, so whichever of two loads went second looked faster."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def warm_cache(files: list[Path]) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 * MiB):
                pass


class ReadTarget:
    """A preallocated, pre-faulted buffer as large as the biggest file: the raw read's floor."""

    def __init__(self, size: int) -> None:
        self.buf = torch.randint(0, 256, (max(1, size),), dtype=torch.uint8)  # pre-faulted, unmergeable
        self.view = memoryview(self.buf.numpy())

    def read_files(self, files: list[Path]) -> float:
        t0 = time.perf_counter()
        for f in files:
            self._read(f, 0, None)
        return time.perf_counter() - t0

    def read_range(self, f: Path, offset: int, n: int) -> float:
        t0 = time.perf_counter()
        self._read(f, offset, n)
        return time.perf_counter() - t0

    def _read(self, f: Path, offset: int, n: int | None) -> None:
        """Bytes [offset, offset + n) of ``f`` (n None: the whole file) into the buffer."""
        fd = os.open(f, os.O_RDONLY)
        try:
            n = os.fstat(fd).st_size if n is None else n
            done = 0
            while done < n:
                got = os.preadv(fd, [self.view[done:n]], offset + done)
                if got <= 0:
                    break
                done += got
        finally:
            os.close(fd)


def read_bytes() -> int:
    """Bytes this process made the storage layer fetch (page-cache misses and readahead)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def load_supports(keyword: str) -> bool:
    import ckptd

    return keyword in inspect.signature(ckptd.load).parameters


# -- the measurements ---------------------------------------------------------------------
@dataclasses.dataclass
class Lab:
    base: Path
    args: argparse.Namespace
    states: dict[str, dict[str, torch.Tensor]]
    daemons: dict[str, DaemonProcess] = dataclasses.field(default_factory=dict)
    producers: dict[str, Any] = dataclasses.field(default_factory=dict)
    samples: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    step: int = 0
    rounds: int = 0

    def record(self, key: str, value: float | None) -> None:
        if value is not None:
            self.samples.setdefault(key, []).append(value)

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def close(self) -> None:
        for p in self.producers.values():
            with contextlib.suppress(Exception):
                p.close()
        for d in self.daemons.values():
            d.close()


def start(lab: Lab) -> None:
    args = lab.args
    staging = max(nbytes_of(s) for s in lab.states.values()) + 4096 * (args.small + args.tensors + 2)
    disk = lab.base / "disk"
    fields = {f.name for f in dataclasses.fields(__import__("ckptd.config").config.DaemonConfig)}
    reuse_ok = "reuse_unchanged" in fields
    # parts 1-4 measure the write path: the same tensors every round must be written
    # every round, not recognised as unchanged (part 5 measures that, on its own daemons)
    keys = {"nice": 19} | ({"reuse_unchanged": False} if reuse_ok else {}) | dict(args.daemon_set)
    lab.daemons["disk"] = DaemonProcess(disk, None, name="chunk", keys=keys | {"format": "chunk"},
                                        tables={"retention": {"keep_last": 1}})
    if reuse_ok:  # one daemon (and producer) each: a plain save between two frozen= ones resets frozen=
        for key in ("lora", "lora_seen"):
            lab.daemons[key] = DaemonProcess(disk, None, name=key, keys=keys | {"reuse_unchanged": True},
                                             tables={"retention": {"keep_last": 1}})
    else:
        lab.notes.append("part 5: this ckptd has no [daemon] reuse_unchanged nor save(frozen=): every byte "
                         "is written at every step")
    lab.daemons["h5"] = DaemonProcess(disk, None, name="hdf5", keys=keys | {"format": "hdf5"},
                                      tables={"retention": {"keep_last": 1}})
    threads_ok = "writer_threads" in fields
    if args.ramdisk is not None:
        ram = Path(tempfile.mkdtemp(prefix="ckptd-limits-ram-", dir=args.ramdisk))
        lab.ram = ram
        for n in args.writer_threads:
            if n != 1 and not threads_ok:
                lab.notes.append(f"writer_threads={n}: this ckptd has no [daemon] writer_threads")
                continue
            extra = {"writer_threads": n} if threads_ok else {}
            lab.daemons[f"ram{n}"] = DaemonProcess(ram, None, name=f"ram{n}", keys=keys | extra,
                                                   tables={"retention": {"keep_last": 1}})
    for d in lab.daemons.values():
        d.start(wait=False)
    for d in lab.daemons.values():
        d.wait_ready()
    for key, d in lab.daemons.items():
        # the LoRA-style state is the large one plus its adapter
        # the LoRA-style state is the large one plus its adapter (staging is memory held
        # all run long: more of it squeezed the page cache that part 4's warm loads read)
        lora = int(staging / (1 - args.adapter)) + 16 * MiB
        lab.producers[key] = producer_for(d, lora if key.startswith("lora") else staging)


def one_round(lab: Lab, record: bool) -> None:
    args, states = lab.args, lab.states
    lab.rounds += 1
    rec = lab.record if record else (lambda key, value: None)
    t = args.timeout
    # -- part 1: the stall ------------------------------------------------------------
    for kind, state in states.items():
        targets = Targets(state)
        floor, floor_cpu = targets.fastest(), targets.fastest_cpu()
        rec(f"memcpy.{kind}", floor)
        rec(f"memcpy.{kind}.cpu", floor_cpu)
        p = lab.producers["disk"]
        calls = [("save", time_save), ("emit", time_emit)]
        if hasattr(p, "emit_many"):
            calls.append(("emit_many", time_emit_many))
        for api, fn in calls if lab.rounds % 2 else calls[::-1]:  # which goes first alternates
            os.sync()
            blocked, durable = fn(p, state, lab.next_step(), t)
            rec(f"{api}.{kind}.blocked", blocked)
            rec(f"{api}.{kind}.x_memcpy", blocked / floor)
            rec(f"{api}.{kind}.cpu", CPU["blocked"])
            rec(f"{api}.{kind}.cpu_x_memcpy", CPU["blocked"] / max(floor_cpu, 1e-6))
    large = states["large"]
    # -- part 2: durable against O_DIRECT, and the RAM disk ------------------------------
    data = lab.direct_buf
    os.sync()
    raw = lab.base / "raw.bin"
    try:
        direct = direct_floor(data, raw, args.block)
    except baselines.DirectIORefused:
        direct = None
        lab.notes.append("O_DIRECT refused under --dir: the buffered write is the floor")
    raw.unlink(missing_ok=True)
    os.sync()
    buffered = baselines.raw_write_fsync(data, raw, args.block)
    raw.unlink(missing_ok=True)
    floor_write = direct or buffered
    rec("raw.direct", direct)
    rec("raw.buffered", buffered)
    os.sync()
    _, durable = time_save(lab.producers["disk"], large, lab.next_step(), t)
    rec("chunk.durable", durable)
    rec("chunk.x_direct", floor_write / durable)
    # -- part 3: HDF5 ------------------------------------------------------------------
    os.sync()
    h5 = baselines.naive_h5py_fsync(large, lab.base / "naive.h5")
    (lab.base / "naive.h5").unlink(missing_ok=True)
    rec("h5py.naive", h5)
    os.sync()
    blocked, durable = time_save(lab.producers["h5"], large, lab.next_step(), t)
    rec("hdf5.durable", durable)
    rec("hdf5.x_h5py", h5 / durable)
    rec("hdf5.x_direct", floor_write / durable)
    rec("hdf5.blocked", blocked)
    rec("hdf5.blocked_x_chunk", blocked / statistics.median(lab.samples.get("save.large.blocked", [blocked]))
        if record else None)
    # -- part 2b: RAM disk, writer threads ---------------------------------------------
    if args.ramdisk is not None:
        raw = lab.ram / "raw.bin"
        ram_write = baselines.raw_write_fsync(data, raw, args.block)
        raw.unlink(missing_ok=True)
        rec("ram.raw", ram_write)
        for key in [k for k in lab.daemons if k.startswith("ram")]:
            _, durable = time_save(lab.producers[key], large, lab.next_step(), t)
            rec(f"{key}.durable", durable)
            rec(f"{key}.x_raw", ram_write / durable)
    # -- part 4: resume ----------------------------------------------------------------
    measure_loads(lab, rec)
    # -- part 5: a checkpoint costs what changed ------------------------------------------
    measure_frozen(lab, rec)
    # -- part 6: the first save of a job -------------------------------------------------
    if args.first_save:
        measure_first_save(lab, rec)


def measure_first_save(lab: Lab, rec: Callable[[str, float | None], None]) -> None:
    """A job's first save with ``staging_size = "auto"`` against its later saves, with no
    hint and with ``expected_bytes=`` (module docstring, 6), in a fresh process, as a
    job's or a restart's first checkpoint is."""
    args = lab.args
    job = {"endpoint": lab.daemons["disk"].endpoint, "size": parse_size(args.size), "tensors": args.tensors,
           "timeout": args.timeout, "step": lab.step}
    lab.step += 16  # the child's steps
    child = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--first-save-job", json.dumps(job)],
                           capture_output=True, text=True, timeout=30 + 16 * args.timeout)
    if child.returncode != 0:
        raise RuntimeError(f"the first-save job failed ({child.returncode}):\n{child.stderr[-4000:]}")
    result = json.loads(child.stdout.strip().splitlines()[-1])
    for note in result.pop("notes"):
        if note not in lab.notes:
            lab.notes.append(note)
    for key, value in result.items():
        rec(key, value)


def first_save_job(job: dict[str, Any]) -> dict[str, Any]:
    """The child of ``measure_first_save``: a fresh process, the same large state."""
    import ckptd
    from ckptd import config as ckptd_config

    t, large = job["timeout"], make_states(job["size"], job["tensors"], 1, 1)["large"]
    nbytes, step = nbytes_of(large), job["step"]
    out: dict[str, Any] = {"notes": []}
    has_expected = "expected_bytes" in {f.name for f in dataclasses.fields(ckptd_config.ProducerConfig)}
    for kind, extra in (("auto", {}), ("expected", {"expected_bytes": nbytes})):
        if extra and not has_expected:
            out["notes"].append("first save: this ckptd has no expected_bytes")
            continue
        p = ckptd.Producer(job["endpoint"], f"{RUN}-first-{kind}", rank=0, world_size=1, transport="shm",
                           staging_size="auto", timeout=60, **extra)
        try:
            t0 = time.perf_counter()
            while extra and p.stats()["staging_bytes"] < nbytes and time.perf_counter() - t0 < t:
                time.sleep(0.01)  # the training steps before a job's first checkpoint
            out[f"first.{kind}.ready_s"] = time.perf_counter() - t0
            times = []
            for i in range(4):
                if i == 2:  # the training steps between checkpoints, while staging grows
                    t1 = time.perf_counter()
                    if "staging_ready_bytes" not in p.stats():  # an older ckptd: a fixed pause
                        time.sleep(3.0)
                    while max(p.stats().get("staging_ready_bytes", nbytes), p.stats()["staging_bytes"]) < nbytes \
                            and time.perf_counter() - t1 < t:
                        time.sleep(0.01)
                    out[f"grown.{kind}.wait_s"] = time.perf_counter() - t1
                os.sync()
                step += 1
                times.append(time_save(p, large, step, t))
        finally:
            p.close()
        # "later" is the job's steady state, the third and fourth saves, once staging has
        # grown; the second comes right after the first, and may find it still growing
        (b1, d1), (b2, d2), later = times[0], times[1], times[2:]
        out.update({
            f"first.{kind}.blocked": b1, f"first.{kind}.durable": d1,
            f"second.{kind}.blocked": b2, f"second.{kind}.durable": d2,
            f"later.{kind}.blocked": statistics.median(b for b, _ in later),
            f"later.{kind}.durable": statistics.median(x for _, x in later),
            f"first.{kind}.blocked_x": b1 / statistics.median(b for b, _ in later),
            f"first.{kind}.durable_x": d1 / statistics.median(x for _, x in later),
        })
    return out


def lora_state(lab: Lab) -> dict[str, Any]:
    """The large state as a frozen base, and an adapter of ``--adapter`` of the bytes
    (default 5%) that changes at every step."""
    base = lab.states["large"]
    adapter_bytes = int(nbytes_of(base) * lab.args.adapter / (1 - lab.args.adapter))
    n = 16
    return {"base": base,
            "lora": {f"l{i}": torch.rand(max(1, adapter_bytes // (4 * n))) for i in range(n)}}


def daemon_written(d: DaemonProcess) -> int:
    """Bytes the daemon process has sent to storage (``/proc/PID/io`` write_bytes)."""
    for line in Path(f"/proc/{d.pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("no write_bytes in /proc/PID/io")


def measure_frozen(lab: Lab, rec: Callable[[str, float | None], None]) -> None:
    """A LoRA-style save: durable time and bytes written against the same state saved
    whole (a daemon with reuse off, no ``frozen=``), in the same round."""
    t = lab.args.timeout
    # the whole save last: its retention deletes a whole step, whose freed blocks slowed
    # the next fsync on this disk (another daemon's, here) by ~0.1 s
    runs = [("frozen", "lora", ["base.*"]), ("recognised", "lora_seen", None)] if "lora" in lab.daemons else []
    runs.append(("full", "disk", None))  # the chunk daemon of parts 1-2: reuse off
    for kind, key, frozen in runs:
        d, p = lab.daemons[key], lab.producers[key]
        state = lora_state(lab)  # a new adapter at every save
        total = nbytes_of(state["base"]) + nbytes_of(state["lora"])
        os.sync()
        before = daemon_written(d)
        step = lab.next_step()
        kwargs = {"frozen": frozen} if frozen else {}
        t0 = time.perf_counter()
        handle = p.save(state, step, **kwargs)
        blocked = time.perf_counter() - t0
        handle.wait(t)
        durable = time.perf_counter() - t0
        written = daemon_written(d) - before
        rec(f"lora.{kind}.durable", durable)
        rec(f"lora.{kind}.blocked", blocked)
        rec(f"lora.{kind}.written_mb", written / 1e6)
        rec(f"lora.{kind}.x_bytes", written / total)
    rec("lora.total_mb", total / 1e6)
    if "lora.full.durable" in lab.samples and "lora" in lab.daemons:
        for kind in ("frozen", "recognised"):
            rec(f"lora.{kind}.x_full", lab.samples[f"lora.{kind}.durable"][-1] / lab.samples["lora.full.durable"][-1])


def measure_loads(lab: Lab, rec: Callable[[str, float | None], None]) -> None:
    import ckptd

    d = lab.daemons["disk"]
    # the newest step of the chunk daemon on disk: part 2's
    info = ckptd.latest(RUN, root=d.root)
    step = info.step
    files = step_files(d.root, step)
    target = lab.read_target
    out_state = lab.out_state
    has_out, has_mmap = load_supports("out"), load_supports("mmap")

    def touch_all(loaded: dict[str, Any]) -> None:
        for name, t in loaded.items():
            lab.touch[name].copy_(t)

    # the peer for a plain load: torch.load of the same tensors, saved once by torch.save
    pt = d.root.parent / "torch-save.pt"
    if not pt.exists():
        torch.save(lab.states["large"], pt)
    for temp in ("warm", "cold"):
        prep = (lambda: warm_cache(files)) if temp == "warm" else (lambda: drop_cache(files))
        prep()
        raw = target.read_files(files)
        rec(f"read.{temp}", raw)

        def plain_load() -> float:
            prep()
            fresh_memory()
            t0 = time.perf_counter()
            loaded = ckptd.load(RUN, step, root=d.root)
            dt = time.perf_counter() - t0
            del loaded
            return dt

        def peer_load() -> float:
            (warm_cache if temp == "warm" else drop_cache)([pt])
            fresh_memory()
            t0 = time.perf_counter()
            loaded = torch.load(pt, weights_only=True)
            dt = time.perf_counter() - t0
            del loaded
            return dt

        took: dict[str, float] = {}
        loads = [("plain", plain_load), ("peer", peer_load)]
        for name, load in loads if lab.rounds % 2 else loads[::-1]:  # which goes first alternates
            took[name] = load()
        plain, peer = took["plain"], took["peer"]
        rec(f"load.{temp}", plain)
        rec(f"load.{temp}.x_read", raw / plain)
        rec(f"torch_load.{temp}", peer)
        rec(f"load.{temp}.x_torch", peer / plain)
        if has_out:
            prep()
            t0 = time.perf_counter()
            ckptd.load(RUN, step, root=d.root, out=out_state)
            dt = time.perf_counter() - t0
            rec(f"load_out.{temp}", dt)
            rec(f"load_out.{temp}.x_read", raw / dt)
        if has_mmap:
            prep()
            t0 = time.perf_counter()
            mapped = ckptd.load(RUN, step, root=d.root, mmap=True)
            opened = time.perf_counter() - t0
            touch_all(mapped)
            dt = time.perf_counter() - t0
            del mapped
            rec(f"load_mmap.{temp}.open", opened)
            rec(f"load_mmap.{temp}", dt)
            rec(f"load_mmap.{temp}.x_read", raw / dt)
    # selective, cold: one tensor from the middle of a file
    manifest = json.loads((d.root / RUN / f"step-{step:012d}" / "manifest-r00000.json").read_text())
    names = sorted(manifest["tensors"])
    name = names[len(names) // 2]
    r = manifest["tensors"][name]
    f = d.root / RUN / f"step-{step:012d}" / r["file"]
    drop_cache(files)
    b0 = read_bytes()
    raw_t = target.read_range(f, r["offset"], r["nbytes"])
    raw_b = read_bytes() - b0
    drop_cache(files)
    b0 = read_bytes()
    t0 = time.perf_counter()
    ckptd.load(RUN, step, root=d.root, names=[name])
    sel_t = time.perf_counter() - t0
    sel_b = read_bytes() - b0
    rec("select.asked_mb", r["nbytes"] / 1e6)
    rec("select.read_mb", sel_b / 1e6)
    rec("select.raw_mb", raw_b / 1e6)
    rec("select.x_bytes", sel_b / max(1, raw_b))
    rec("select.time", sel_t)
    rec("select.raw_time", raw_t)
    rec("select.x_time", sel_t / raw_t)


# -- the report ---------------------------------------------------------------------------
GOALS: list[tuple[str, str, str, float, str]] = [
    # (label, ratio key, detail keys, limit, "<=" or ">=")
    ("save blocked, 64 large / memcpy", "save.large.x_memcpy", "save.large.blocked memcpy.large", 1.1, "<="),
    ("emit blocked, 64 large / memcpy", "emit.large.x_memcpy", "emit.large.blocked memcpy.large", 1.1, "<="),
    ("save blocked, small / memcpy", "save.small.x_memcpy", "save.small.blocked memcpy.small", 1.1, "<="),
    ("emit blocked, small / memcpy", "emit.small.x_memcpy", "emit.small.blocked memcpy.small", 1.1, "<="),
    ("durable chunk, x O_DIRECT write+fsync", "chunk.x_direct", "chunk.durable raw.direct", 0.95, ">="),
    ("durable hdf5, x naive h5py", "hdf5.x_h5py", "hdf5.durable h5py.naive", 1.0, ">="),
    ("durable hdf5, x O_DIRECT", "hdf5.x_direct", "hdf5.durable raw.direct", 0.85, ">="),
    ("hdf5 save blocked / chunk's", "hdf5.blocked_x_chunk", "hdf5.blocked save.large.blocked", 1.1, "<="),
    ("load warm, x raw read", "load.warm.x_read", "load.warm read.warm", 0.95, ">="),
    ("load cold, x raw read", "load.cold.x_read", "load.cold read.cold", 0.95, ">="),
    ("load warm, x torch.load", "load.warm.x_torch", "load.warm torch_load.warm", 1.0, ">="),
    ("load cold, x torch.load", "load.cold.x_torch", "load.cold torch_load.cold", 1.0, ">="),
    ("load(out=) warm, x raw read", "load_out.warm.x_read", "load_out.warm read.warm", 0.91, ">="),
    ("load(out=) cold, x raw read", "load_out.cold.x_read", "load_out.cold read.cold", 0.91, ">="),
    ("load(mmap=True)+read all warm, x raw", "load_mmap.warm.x_read", "load_mmap.warm read.warm", 0.95, ">="),
    ("load(mmap=True)+read all cold, x raw", "load_mmap.cold.x_read", "load_mmap.cold read.cold", 0.95, ">="),
    ("load(names=[1]) cold, bytes / plain read", "select.x_bytes", "select.read_mb select.raw_mb", 1.05, "<="),
    ("load(names=[1]) cold, time / plain read", "select.x_time", "select.time select.raw_time", 1.05, "<="),
    ("5% changes, frozen=: bytes written / state", "lora.frozen.x_bytes", "lora.frozen.written_mb lora.total_mb",
     0.06, "<="),
    ("5% changes, frozen=: durable / whole save", "lora.frozen.x_full", "lora.frozen.durable lora.full.durable",
     0.10, "<="),
    ("5% changes, recognised: bytes / state", "lora.recognised.x_bytes",
     "lora.recognised.written_mb lora.total_mb", 0.06, "<="),
    ("5% changes, recognised: durable / whole", "lora.recognised.x_full",
     "lora.recognised.durable lora.full.durable", 0.10, "<="),
]


GOALS += [  # part 1: emit_many, the plan for blocks that emit the same tensors
    ("emit_many blocked, 64 large / memcpy", "emit_many.large.x_memcpy", "emit_many.large.blocked memcpy.large",
     1.1, "<="),
    ("emit_many blocked, small / memcpy", "emit_many.small.x_memcpy", "emit_many.small.blocked memcpy.small",
     1.5, "<="),
]
GOALS += [  # part 6: the first save of a job, against the same job's later saves
    ("first save, auto: blocked / later saves'", "first.auto.blocked_x", "first.auto.blocked later.auto.blocked",
     2.0, "<="),
    ("first save, auto: durable / later saves'", "first.auto.durable_x", "first.auto.durable later.auto.durable",
     1.5, "<="),
    ("first save, expected_bytes: blocked / later", "first.expected.blocked_x",
     "first.expected.blocked later.expected.blocked", 2.0, "<="),
    ("first save, expected_bytes: durable / later", "first.expected.durable_x",
     "first.expected.durable later.expected.durable", 1.5, "<="),
]


def med(lab: Lab, key: str) -> float | None:
    xs = lab.samples.get(key)
    return statistics.median(xs) if xs else None


def fmt(x: float | None, key: str) -> str:
    if x is None:
        return "n/a"
    return f"{x:.1f} MB" if key.endswith("_mb") else f"{x:.4f} s"


def report(lab: Lab) -> list[dict[str, Any]]:
    rows = []
    print(f"\n{'figure':44} {'ckptd':>12} {'floor/peer':>12} {'ratio':>7}  goal      verdict")
    for label, key, detail, limit, op in GOALS:
        a, b = detail.split()
        r = med(lab, key)
        ok = None if r is None else (r <= limit if op == "<=" else r >= limit)
        verdict = "n/a" if ok is None else ("met" if ok else "MISSED")
        print(f"{label:44} {fmt(med(lab, a), a):>12} {fmt(med(lab, b), b):>12} "
              f"{'n/a' if r is None else f'{r:.2f}':>7}  {op}{limit:<7} {verdict}")
        rows.append({"figure": label, "ratio": r, "goal": f"{op}{limit}", "met": ok,
                     "ckptd": med(lab, a), "floor": med(lab, b)})
    nbytes = nbytes_of(lab.states["large"])
    ram = [k for k in lab.samples if k.startswith("ram") and k.endswith(".durable") and k != "ram.raw"]
    if "ram.raw" in lab.samples:
        print(f"\nRAM disk ({lab.args.ramdisk}, tmpfs): buffered write+fsync {nbytes / med(lab, 'ram.raw') / 1e9:.2f} GB/s")
        for k in sorted(ram, key=lambda k: int(k[3:].split(".")[0])):
            n = k[3:].split(".")[0]
            print(f"  daemon, writer_threads={n}: {nbytes / med(lab, k) / 1e9:.2f} GB/s durable "
                  f"({med(lab, f'ram{n}.x_raw'):.2f}x the buffered write)")
    if "chunk.durable" in lab.samples:
        print(f"\ndisk: chunk durable {nbytes / med(lab, 'chunk.durable') / 1e9:.2f} GB/s, O_DIRECT "
              f"{nbytes / med(lab, 'raw.direct') / 1e9 if 'raw.direct' in lab.samples else float('nan'):.2f} GB/s, "
              f"buffered {nbytes / med(lab, 'raw.buffered') / 1e9:.2f} GB/s; hdf5 durable "
              f"{nbytes / med(lab, 'hdf5.durable') / 1e9:.2f} GB/s, naive h5py {nbytes / med(lab, 'h5py.naive') / 1e9:.2f} GB/s")
    if "first.expected.ready_s" in lab.samples:
        print(f"first save, expected_bytes: staging made {med(lab, 'first.expected.ready_s'):.2f} s after the "
              "producer, in the background (the training steps before a first checkpoint)")
    if "second.auto.blocked" in lab.samples:
        print(f"first save, auto, blocked / durable: first {med(lab, 'first.auto.blocked'):.2f} s / "
              f"{med(lab, 'first.auto.durable'):.2f} s, the second right after it "
              f"{med(lab, 'second.auto.blocked'):.2f} s / {med(lab, 'second.auto.durable'):.2f} s, later "
              f"{med(lab, 'later.auto.blocked'):.2f} s / {med(lab, 'later.auto.durable'):.2f} s; staging grew "
              f"{med(lab, 'grown.auto.wait_s'):.2f} s after the second")
    if "load_mmap.warm.open" in lab.samples:
        print(f"load(mmap=True) open only: warm {med(lab, 'load_mmap.warm.open'):.4f} s, "
              f"cold {med(lab, 'load_mmap.cold.open'):.4f} s")
    print(f"selective: asked {med(lab, 'select.asked_mb'):.1f} MB, ckptd read {med(lab, 'select.read_mb'):.1f} MB "
          f"from disk, a plain read of the range {med(lab, 'select.raw_mb'):.1f} MB")
    print("the stall in CPU seconds of the calling thread (immune to waiting for a busy CPU): "
          + ", ".join(f"{api} {kind} {med(lab, f'{api}.{kind}.cpu_x_memcpy'):.2f}x memcpy's"
                      for kind in lab.states for api in ("save", "emit", "emit_many") if f"{api}.{kind}.cpu_x_memcpy" in lab.samples))
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for note in lab.notes:
        print(f"note: {note}")
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--first-save-job"]:  # measure_first_save's child
        print(json.dumps(first_save_job(json.loads(argv[1]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="bytes of the large state (default 1GiB)")
    ap.add_argument("--tensors", type=int, default=64, help="tensors of the large state (default 64)")
    ap.add_argument("--small", type=int, default=10_000, help="tensors of the small state (default 10000)")
    ap.add_argument("--small-size", default="64MiB", help="bytes of the small state (default 64MiB)")
    ap.add_argument("--repeat", type=int, default=5, help="measured repeats after one warm-up (default 5)")
    ap.add_argument("--dir", type=Path, default=None, help="where the disk figures are taken (default: temp dir)")
    ap.add_argument("--ramdisk", type=Path, default=Path("/dev/shm"),
                    help="a tmpfs for the RAM-disk figures (default /dev/shm); 'none' to skip")
    ap.add_argument("--writer-threads", default="1,2,4", help="[daemon] writer_threads to try on the RAM disk")
    ap.add_argument("--daemon-set", action="append", default=[], metavar="KEY=VALUE",
                    help="another [daemon] key for every daemon (JSON value), repeatable")
    ap.add_argument("--block", default="64MiB", help="write size of the raw writes")
    ap.add_argument("--adapter", type=float, default=0.05,
                    help="part 5: the share of a LoRA-style state's bytes that changes per step (default 0.05)")
    ap.add_argument("--first-save", action=argparse.BooleanOptionalAction, default=True,
                    help="part 6: a job's first save with staging_size=\"auto\" (default on)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", type=Path, default=None, help="write every sample and the table here")
    args = ap.parse_args(argv)
    if str(args.ramdisk) == "none":
        args.ramdisk = None
    args.block = parse_size(args.block)
    args.writer_threads = [int(x) for x in args.writer_threads.split(",") if x]
    args.daemon_set = [(k, json.loads(v) if v[:1] in "0123456789tf[\"" else v)
                       for k, v in (kv.split("=", 1) for kv in args.daemon_set)]
    for var in ENV_ISOLATE:
        os.environ.pop(var, None)
    size, small_size = parse_size(args.size), parse_size(args.small_size)
    base = Path(tempfile.mkdtemp(prefix="ckptd-limits-", dir=args.dir)).resolve()
    print(f"{size / MiB:.0f} MiB in {args.tensors} tensors, {small_size / MiB:.0f} MiB in {args.small} tensors; "
          f"{args.repeat} repeats under {base}", flush=True)
    lab = Lab(base, args, make_states(size, args.tensors, small_size, args.small))
    lab.ram = None
    import mmap as mmap_mod

    nbytes = nbytes_of(lab.states["large"])
    mm = mmap_mod.mmap(-1, -(-nbytes // 4096) * 4096)
    view = memoryview(mm)
    off = 0
    for t in lab.states["large"].values():
        n = t.numel() * 4
        view[off:off + n] = t.numpy().tobytes()
        off += n
    lab.direct_buf = view[:nbytes]
    lab.read_target = ReadTarget(nbytes + 64 * MiB)
    lab.out_state = {k: torch.rand_like(v) for k, v in lab.states["large"].items()}
    lab.touch = {k: torch.rand_like(v) for k, v in lab.states["large"].items()}
    try:
        start(lab)
        print("warm-up round ...", flush=True)
        one_round(lab, record=False)
        for i in range(args.repeat):
            print(f"repeat {i + 1}/{args.repeat} ...", flush=True)
            one_round(lab, record=True)
        rows = report(lab)
        for key, d in lab.daemons.items():
            for line in d.problems()[:3]:
                print(f"note: daemon {key}: {line}")
        if args.json:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"rows": rows, "samples": lab.samples, "notes": lab.notes,
                                             "git": commit, "cpus": os.cpu_count(),
                                             "argv": sys.argv[1:]}, indent=1) + "\n")
    finally:
        lab.close()
        shutil.rmtree(base, ignore_errors=True)
        if lab.ram is not None:
            shutil.rmtree(lab.ram, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
