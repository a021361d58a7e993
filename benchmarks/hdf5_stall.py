#!/usr/bin/env python3
"""Does writing HDF5 stall a Python loop in the same process? The measurement behind
the choice of a writer thread for HDF5 (docs/design.md).

    python benchmarks/hdf5_stall.py [--size 256MiB] [--tensors 16]

The main thread stands in for the daemon's receive loop: it runs small units of
Python work and records the gap between consecutive units. Meanwhile the payload
(random float32, as many equal tensors) is written to one HDF5 file and fsynced by:

  idle            nothing (the loop's own rate on this machine, for reference)
  thread:h5py     a thread: h5py create_dataset(data=...) per tensor
  thread:gzip     the same with gzip (level 4), chunks auto
  thread:lzf      the same with lzf
  thread:pwritev  a thread: h5py creates contiguous datasets (metadata only, space
                  allocated at once), then os.pwritev puts the bytes at their offsets
                  (what ckptd does for compression = "none", chunk_shape = "none")
  process:h5py    a thread copies each tensor into shared memory; a child process
                  writes it with h5py (the writer-process design: the loop shares
                  no lock and no GIL with h5py, at the cost of one more copy)

For each: the write's seconds and MiB/s, the loop's rate relative to idle, and its
longest gap (a receive loop that stalls this long leaves the socket undrained).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ckptd.config import parse_size  # noqa: E402
from hdf5_bench import _fsync  # noqa: E402  (this folder is on sys.path when run as a script)


def write_h5py(path: str, arrays: list[np.ndarray], **filters: object) -> None:
    with h5py.File(path, "w") as f:
        for i, a in enumerate(arrays):
            f.create_dataset(f"t{i}", data=a, **filters)
    _fsync(path)


def write_pwritev(path: str, arrays: list[np.ndarray]) -> None:
    offsets = []
    with h5py.File(path, "w") as f:
        for i, a in enumerate(arrays):
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_layout(h5py.h5d.CONTIGUOUS)
            dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
            dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
            ds = h5py.h5d.create(f.id, f"t{i}".encode(), h5py.h5t.py_create(a.dtype),
                                 h5py.h5s.create_simple(a.shape), dcpl=dcpl)
            offsets.append(ds.get_offset())
    fd = os.open(path, os.O_WRONLY)
    try:
        for a, off in zip(arrays, offsets):
            os.pwritev(fd, [memoryview(a).cast("B")], off)
        os.fsync(fd)
    finally:
        os.close(fd)


def _child(path: str, shm_name: str, nbytes: int, jobs: "mp.Queue", done: "mp.Queue") -> None:
    shm = shared_memory.SharedMemory(shm_name)
    with h5py.File(path, "w") as f:
        while (job := jobs.get()) is not None:
            i, n = job
            f.create_dataset(f"t{i}", data=np.frombuffer(shm.buf, np.float32, n // 4))
            done.put(i)  # the slot may be reused
    _fsync(path)
    shm.close()
    done.put(None)


def write_process(path: str, arrays: list[np.ndarray]) -> None:
    n = arrays[0].nbytes
    shm = shared_memory.SharedMemory(create=True, size=n)
    ctx = mp.get_context("spawn")
    jobs, done = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_child, args=(path, shm.name, n, jobs, done))
    child.start()
    try:
        for i, a in enumerate(arrays):
            np.copyto(np.frombuffer(shm.buf, np.float32, a.size), a)  # the extra copy
            jobs.put((i, a.nbytes))
            done.get()
        jobs.put(None)
        done.get()
        child.join()
    finally:
        shm.close()
        shm.unlink()


MODES = {
    "idle": lambda path, arrays: time.sleep(1.0),
    "thread:h5py": write_h5py,
    "thread:gzip": lambda path, arrays: write_h5py(path, arrays, compression="gzip", compression_opts=4),
    "thread:lzf": lambda path, arrays: write_h5py(path, arrays, compression="lzf"),
    "thread:pwritev": write_pwritev,
    "process:h5py": write_process,
}


def measure(mode: str, arrays: list[np.ndarray], folder: str) -> dict[str, float]:
    path = os.path.join(folder, "x.h5")
    finished = threading.Event()
    took: list[float] = []

    def work() -> None:
        t0 = time.perf_counter()
        MODES[mode](path, arrays)
        took.append(time.perf_counter() - t0)
        finished.set()

    gaps = []
    units = 0
    th = threading.Thread(target=work)
    start = last = time.perf_counter()
    th.start()
    while not finished.is_set():
        sum(range(200))  # a few microseconds of Python: one "message handled"
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        units += 1
    elapsed = time.perf_counter() - start
    th.join()
    if os.path.exists(path):
        os.unlink(path)
    return {"write_s": took[0], "rate": units / elapsed, "max_gap_ms": max(gaps) * 1e3,
            "gaps_over_10ms": sum(g > 0.01 for g in gaps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    nbytes = parse_size(args.size)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(nbytes // 4 // args.tensors).astype(np.float32) for _ in range(args.tensors)]
    total = sum(a.nbytes for a in arrays)
    folder = tempfile.mkdtemp(prefix="ckptd-h5stall-", dir=args.dir)
    try:
        rows = {mode: measure(mode, arrays, folder) for mode in MODES}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    idle = rows["idle"]["rate"]
    print(f"{total / 2**20:.0f} MiB in {args.tensors} float32 tensors, h5py {h5py.version.version}, "
          f"HDF5 {h5py.version.hdf5_version}, {os.cpu_count()} CPUs\n")
    print(f"{'writer':<16} {'write s':>8} {'MiB/s':>8} {'loop rate':>10} {'max gap ms':>11} {'gaps>10ms':>10}")
    for mode, r in rows.items():
        mibs = "-" if mode == "idle" else f"{total / 2**20 / r['write_s']:.0f}"
        write_s = "-" if mode == "idle" else f"{r['write_s']:.2f}"
        print(f"{mode:<16} {write_s:>8} {mibs:>8} {r['rate'] / idle:>9.0%} "
              f"{r['max_gap_ms']:>11.1f} {r['gaps_over_10ms']:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
