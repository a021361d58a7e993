#!/usr/bin/env python3
"""The CUDA path (docs/training.md), checked and measured on a machine with a GPU.

    python benchmarks/cuda_check.py [--size 4GiB] [--tensors 64] [--repeat 3]

Starts a real ``ckptd serve`` on a temp root and, for ``gpu_snapshot = "host"`` and
``"device"``:

* snapshot semantics: every CUDA tensor is overwritten on the current stream right
  after ``emit`` returns; the checkpoint must hold the values at ``emit`` time;
* the CPU time ``emit`` costs for ``--size`` of CUDA tensors (``time.process_time`` of
  the calling thread's process, and wall time), goal: under 5 ms for 4 GiB;
* the device-to-host bandwidth the snapshot reached (bytes / time from the first
  emit until every copy's event completed), against a plain pinned
  ``cudaMemcpyAsync`` of the same bytes into page-locked memory: goal >= 80%;
* ``load(map_location="cuda")`` (docs/performance.md: through pinned buffers, the copy to the
  GPU overlapped with the reads): bit-exact, and its GB/s against ``load()`` then
  ``.to("cuda")``.

Prints one line per measurement and exits 1 if a snapshot is wrong. Not run on the
development machines (no GPU); it needs one CUDA device and about 3x ``--size`` of
host memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import ckptd
from ckptd.config import parse_size


def pinned_baseline(src: list[torch.Tensor]) -> float:
    """Seconds for device-to-host copies of ``src`` into pinned memory on one stream."""
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in src]
    for d, s in zip(dst, src):  # warm-up
        d.copy_(s, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def checkpoint(p: ckptd.Producer, state: dict[str, torch.Tensor], step: int) -> tuple[float, float, float]:
    """Emit every tensor, overwrite it at once; return (cpu s, wall s of emit, s until copied)."""
    torch.cuda.synchronize()
    cpu0, t0 = time.process_time(), time.perf_counter()
    with p.checkpoint(step) as handle:
        for name, t in state.items():
            p.emit(name, t)
            t.fill_(-1.0)  # on the current stream: must wait for (host) or not touch (device) the copy
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    torch.cuda.synchronize()  # the side stream's copies are done too once the device is idle
    copied = time.perf_counter() - t0
    handle.wait(600)
    return cpu, wall, copied


def check_cuda_load(root: Path, run: str, step: int, originals: list[torch.Tensor], total: int) -> bool:
    """``load(map_location="cuda")`` (ckptd.devicecopy: pinned buffers, copies overlapped)
    against ``load()`` then ``.to("cuda")``, warm page cache; True if a tensor is wrong."""
    ckptd.load(run, step, root=root)  # the files into the page cache
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = ckptd.load(run, step, root=root, map_location="cuda")
        torch.cuda.synchronize()
        ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        plain = {n: t.to("cuda") for n, t in ckptd.load(run, step, root=root).items()}
        torch.cuda.synchronize()
        theirs = time.perf_counter() - t0
    bad = [n for i, (n, t) in enumerate(sorted(got.items())) if t.device.type != "cuda" or not torch.equal(t, originals[i])]
    print(f"load(map_location='cuda'): {total / ours / 1e9:.2f} GB/s; load() then .to('cuda'): "
          f"{total / theirs / 1e9:.2f} GB/s ({theirs / ours:.2f}x); {'WRONG for ' + ', '.join(bad[:5]) if bad else 'exact'}")
    del plain
    return bool(bad)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="4GiB")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here", file=sys.stderr)
        return 2
    nbytes = parse_size(args.size)
    numel = nbytes // 4 // args.tensors
    base = Path(tempfile.mkdtemp(prefix="ckptd-cuda-"))
    sock = Path(tempfile.mkdtemp(prefix="ckc", dir="/tmp"))
    (base / "c.toml").write_text(f'[daemon]\nendpoint = "ipc://{sock}/d.sock"\nroot = "{base}/root"\n')
    daemon = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "-c", str(base / "c.toml")])
    failed = False
    try:
        while not (sock / "d.sock").exists():
            if daemon.poll() is not None:
                raise SystemExit("the daemon did not start")
            time.sleep(0.05)
        gen = torch.Generator(device="cuda").manual_seed(0)
        originals = [torch.rand(numel, device="cuda", generator=gen) for _ in range(args.tensors)]
        total = sum(t.numel() * 4 for t in originals)
        base_s = min(pinned_baseline(originals) for _ in range(3))
        print(f"pinned cudaMemcpyAsync D2H: {total / base_s / 1e9:.2f} GB/s ({total / 2**30:.2f} GiB)")
        for mode in ("host", "device"):
            with ckptd.Producer(f"ipc://{sock}/d.sock", f"cuda-{mode}", gpu_snapshot=mode,
                                staging_size=total + 2**20, timeout=60) as p:
                for step in range(args.repeat + 1):  # step 0 warms up (pins the arena)
                    state = {f"t{i:03d}": t.clone() for i, t in enumerate(originals)}
                    cpu, wall, copied = checkpoint(p, state, step)
                    if step:
                        print(f"gpu_snapshot={mode} step {step}: emit CPU {cpu * 1e3:.1f} ms, wall {wall * 1e3:.1f} ms; "
                              f"D2H {total / copied / 1e9:.2f} GB/s = {base_s / copied:.0%} of pinned")
                got = ckptd.load(f"cuda-{mode}", args.repeat, root=base / "root", verify=True)
                bad = [n for i, (n, t) in enumerate(sorted(got.items())) if not torch.equal(t, originals[i].cpu())]
                print(f"gpu_snapshot={mode}: snapshot {'WRONG for ' + ', '.join(bad[:5]) if bad else 'exact'}")
                failed |= bool(bad)
        failed |= check_cuda_load(base / "root", "cuda-host", args.repeat, originals, total)
    finally:
        daemon.terminate()
        daemon.wait(60)
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(sock, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.pop("CKPTD_CONFIG", None)
    sys.exit(main())
