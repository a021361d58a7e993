#!/usr/bin/env python3
"""ckptd writing HDF5 against the naive h5py approach, on the same bytes, in one run.

    python benchmarks/hdf5_bench.py --size 1GiB --tensors 64 --repeat 3 [--compression gzip]

Each repeat runs, interleaved (see benchmarks/README.md for why):

* ``memcpy``: the floor of any snapshot of the state (bench.py's fastest copy).
* ``ckptd hdf5``: ``emit`` of every tensor into one ``ckptd serve`` with the run's
  format set to HDF5 by its producer (``Producer(..., format="hdf5")``); ``blocked``
  is the time spent inside ``emit``, ``commit`` from the first ``emit`` until the
  commit is acknowledged (file and manifest fsynced).
* ``ckptd chunk``: the same through a second producer of the same daemon, format
  chunk: the figure ``ckptd hdf5``'s blocking time is held to.
* ``naive h5py``: ``h5py.File(path, "w")``, one ``create_dataset(name, data=t.numpy())``
  per tensor, ``flush``, ``fsync``: the caller is blocked for all of it.
* ``raw write + fsync``: the disk's floor (bench.py's).

``--compression gzip|lzf`` applies to both ckptd (``[hdf5]``, chunk_shape "auto")
and the naive writer. Goals (docs/performance.md): ckptd's HDF5 commit throughput >= the
naive approach's; its blocking time no worse than with chunk files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import h5py
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the shared parts: state, daemon, baselines)
from baselines import fsync_path  # noqa: E402

import ckptd  # noqa: E402
from ckptd.config import parse_size  # noqa: E402

GB = bench.GB


def naive_h5py(state: dict[str, torch.Tensor], path: Path, compression: str) -> float:
    """What a user writes by hand: a dataset per tensor, then flush and fsync."""
    filters = {} if compression == "none" else {"compression": compression}
    t0 = time.perf_counter()
    with h5py.File(path, "w") as f:
        for name, t in state.items():
            f.create_dataset(name, data=t.numpy(), **filters)
        f.flush()
    fsync_path(path)  # after close, which writes the last metadata
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def ckptd_emit(p: ckptd.Producer, run: str, root: Path, state: dict[str, torch.Tensor], step: int,
               timeout: float) -> tuple[float, float]:
    r = bench.ckptd_emit(p, state, step, timeout)
    shutil.rmtree(root / run / f"step-{step:012d}", ignore_errors=True)
    return r.blocked_s, r.commit_s


def run(args: argparse.Namespace) -> dict[str, Any]:
    for var in bench._ENV_ISOLATE:
        os.environ.pop(var, None)
    base = Path(tempfile.mkdtemp(prefix="ckptd-h5bench-", dir=args.dir)).resolve()
    daemon = producers = None
    try:
        bench.check_disk(base, args.size_bytes)
        state = bench.make_state(args.size_bytes, args.tensors)
        nbytes = bench.state_bytes(state)
        targets = bench.CopyTargets(state)
        daemon = bench.DaemonProcess(base, args.chunk_size)
        if args.compression != "none":
            with open(daemon.config, "a") as f:
                f.write(f'[hdf5]\ncompression = "{args.compression}"\nchunk_shape = "auto"\n')
        daemon.start()
        staging = nbytes + 64 * len(state) + 2**20
        producers = {fmt: ckptd.Producer(daemon.endpoint, f"bench-{fmt}", staging_size=staging, timeout=30,
                                         format=fmt) for fmt in ("hdf5", "chunk")}
        samples: dict[str, list[float]] = {}
        step = 0
        for rnd in range(args.repeat + 1):  # round 0 is the warm-up
            print("warm-up ..." if rnd == 0 else f"repeat {rnd}/{args.repeat} ...", flush=True)
            got: dict[str, float] = {}
            copies = [bench.time_call(f) for f in (targets.torch_copy, targets.numpy_copy, targets.memmove)]
            got["memcpy"] = min(copies)
            order = ["hdf5", "chunk"] if rnd % 2 else ["chunk", "hdf5"]
            for fmt in order:
                os.sync()
                step += 1
                got[f"ckptd.{fmt}.blocked"], got[f"ckptd.{fmt}.commit"] = ckptd_emit(
                    producers[fmt], f"bench-{fmt}", daemon.root, state, step, args.timeout)
            os.sync()
            got["naive_h5py"] = naive_h5py(state, base / "naive.h5", args.compression)
            os.sync()
            got["raw_write_fsync"] = bench.raw_write_fsync(targets.bytes_view(), base / "raw", args.block)
            (base / "raw").unlink()
            if rnd:
                for k, v in got.items():
                    samples.setdefault(k, []).append(v)
        problems = daemon.problems()
        return report(args, nbytes, samples, problems)
    finally:
        for p in (producers or {}).values():
            p.close()
        if daemon is not None:
            daemon.close()
        shutil.rmtree(base, ignore_errors=True)


ROWS = [
    ("memcpy", "memcpy (the floor of a snapshot)"),
    ("ckptd.hdf5.blocked", "ckptd hdf5: caller blocked in emit"),
    ("ckptd.chunk.blocked", "ckptd chunk: caller blocked in emit"),
    ("ckptd.hdf5.commit", "ckptd hdf5: first emit -> commit acked"),
    ("ckptd.chunk.commit", "ckptd chunk: first emit -> commit acked"),
    ("naive_h5py", "naive h5py: create_dataset x N, flush, fsync"),
    ("raw_write_fsync", "raw write + fsync (the disk's floor)"),
]


def report(args: argparse.Namespace, nbytes: int, samples: dict[str, list[float]],
           problems: list[str]) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"\n{nbytes / 2**30:.3f} GiB in {args.tensors} float32 tensors, {args.repeat} repeat(s), "
          f"compression {args.compression}; h5py {h5py.version.version}, HDF5 {h5py.version.hdf5_version}, "
          f"{os.cpu_count()} CPUs; GB/s = 1e9 bytes/s\n")
    print(f"| {'measurement':<46} | {'median s':>8} | {'min s':>8} | {'GB/s med':>8} |")
    print(f"|{'-' * 48}|{'-' * 10}|{'-' * 10}|{'-' * 10}|")
    for key, label in ROWS:
        if key in samples:
            v = samples[key]
            print(f"| {label:<46} | {med[key]:>8.3f} | {min(v):>8.3f} | {nbytes / med[key] / GB:>8.2f} |")
    ratios = {
        "hdf5_commit_gbps_over_naive_h5py_gbps": (med["naive_h5py"] / med["ckptd.hdf5.commit"], ">= 1"),
        "hdf5_blocked_over_chunk_blocked": (med["ckptd.hdf5.blocked"] / med["ckptd.chunk.blocked"], "<= 1 (noise: ~0.2)"),
        "hdf5_blocked_over_memcpy": (med["ckptd.hdf5.blocked"] / med["memcpy"], ""),
        "naive_h5py_blocked_over_hdf5_blocked": (med["naive_h5py"] / med["ckptd.hdf5.blocked"], ""),
        "hdf5_commit_gbps_over_raw_write_gbps": (med["raw_write_fsync"] / med["ckptd.hdf5.commit"], ""),
    }
    print()
    for key, (value, target) in ratios.items():
        print(f"{key:<44} {value:>7.2f}  {target}")
    for line in problems[:10]:
        print(f"note: daemon log: {line}")
    return {"bytes": nbytes, "samples_s": samples, "median_s": med,
            "ratios": {k: v for k, (v, _) in ratios.items()}, "problems": problems}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="total bytes of the state (default 1GiB)")
    ap.add_argument("--tensors", type=int, default=64, help="number of float32 tensors (default 64)")
    ap.add_argument("--repeat", type=int, default=3, help="measured repeats after one warm-up (default 3)")
    ap.add_argument("--compression", choices=("none", "gzip", "lzf"), default="none")
    ap.add_argument("--chunk-size", default=None, help="daemon chunk_size (default: the daemon's)")
    ap.add_argument("--block", default="64MiB", help="os.write size of the raw baseline")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for one commit")
    ap.add_argument("--dir", type=Path, default=None, help="parent of the temp folder (the disk measured)")
    ap.add_argument("--json", type=Path, help="write the raw numbers here")
    args = ap.parse_args()
    args.size_bytes, args.block = parse_size(args.size), parse_size(args.block)
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
