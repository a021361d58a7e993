"""How to issue a checkpoint's writes: threads or io_uring, against the O_DIRECT floor.

The daemon writes a step as chunk files (64 MiB by default), each with O_DIRECT and
fsynced on its own (docs/performance.md, "Where the time goes"). This measures, on the same bytes in
one run, ways to do that with several writes in flight:

- ``floor``: one file, O_DIRECT writes of ``--file-size`` each, one fsync at the end
  (what ``limits.py`` judges the daemon's durable time by);
- ``threads N``: N threads each take the next chunk file and write it in one call,
  then fsync it (what ``[daemon] writer_threads`` does; ``write`` and ``fsync``
  release the GIL);
- ``io_uring D x P``: one thread and one ring, D chunk files in flight, each written
  in pieces of P bytes and linked to its fsync (``IOSQE_IO_LINK``), the next file
  submitted as soon as one's fsync completes. Needs the ``liburing`` binding (PyPI
  ``liburing``, in ``benchmarks/requirements.txt``); without it only the rest runs.

Each variant runs once per repeat, in alternating order, after ``os.sync()``, and is
reported as its median time, throughput, CPU seconds of the process (kernel threads
that io_uring hands work to are the process's own) and the median of its time
paired with the floor's in the same repeat. ``--ramdisk`` does the same on a tmpfs,
where the device is not the limit (tmpfs takes O_DIRECT as a buffered copy).

    .venv/bin/python benchmarks/write_engines.py                      # 1 GiB, 8 repeats, /tmp and /dev/shm
    .venv/bin/python benchmarks/write_engines.py --dir /mnt/nvme --repeat 4
"""

from __future__ import annotations

import argparse
import mmap
import os
import queue
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import baselines  # noqa: E402  (benchmarks/, this script's folder)
from ckptd.config import parse_size  # noqa: E402

try:
    import liburing
except ImportError:  # the threads and the floor still run
    liburing = None

WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC


class Bytes:
    """``size`` bytes of incompressible data in page-aligned, pre-faulted memory (the
    shared arena the daemon writes from is such memory)."""

    def __init__(self, size: int) -> None:
        self._mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        self.view = memoryview(self._mm)
        block = os.urandom(1 << 20)
        for off in range(0, size, len(block)):
            n = min(len(block), size - off)
            self.view[off:off + n] = block[:n]


class Engines:
    """The variants, writing ``data`` under ``folder`` as files of ``file_size``."""

    def __init__(self, data: memoryview, folder: Path, file_size: int) -> None:
        if len(data) % file_size:
            raise SystemExit(f"--size must be a multiple of --file-size ({file_size} bytes)")
        self.data, self.folder, self.file_size = data, folder, file_size
        self.nfiles = len(data) // file_size

    def _path(self, i: int) -> str:
        return str(self.folder / f"chunk-{i:05d}")

    def _piece(self, i: int) -> memoryview:
        return self.data[i * self.file_size:(i + 1) * self.file_size]

    def floor(self) -> None:
        baselines.raw_write_direct(self.data, Path(self._path(0)), self.file_size)

    def threads(self, n: int) -> None:
        todo: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(self.nfiles):
            todo.put(i)
        failures: list[BaseException] = []

        def work() -> None:
            try:
                while True:
                    try:
                        i = todo.get_nowait()
                    except queue.Empty:
                        return
                    fd = os.open(self._path(i), WRITE_FLAGS, 0o644)
                    try:
                        baselines.write_all(fd, self._piece(i), self.file_size)
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            except BaseException as exc:  # reported by the caller, not lost in a thread
                failures.append(exc)

        workers = [threading.Thread(target=work, name=f"writer-{k}") for k in range(n)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if failures:
            raise failures[0]

    def uring(self, depth: int, piece: int) -> None:
        assert liburing is not None
        if self.file_size % piece:
            raise SystemExit(f"an io_uring piece ({piece} bytes) must divide --file-size")
        ring, cqe = liburing.Ring(), liburing.Cqe()
        liburing.io_uring_queue_init(max(8, depth * (self.file_size // piece + 1)), ring, 0)
        fds: dict[int, int] = {}
        left: dict[int, int] = {}  # file -> operations not completed yet
        iovecs: list[Any] = []  # each write's Iovec stays alive until the ring is done
        try:
            def submit(i: int) -> None:
                fds[i] = fd = os.open(self._path(i), WRITE_FLAGS, 0o644)
                for off in range(0, self.file_size, piece):
                    # prep_write takes only bytes; an Iovec takes a memoryview without copying it
                    iov = liburing.Iovec([self._piece(i)[off:off + piece]])
                    iovecs.append(iov)
                    sqe = liburing.io_uring_get_sqe(ring)
                    liburing.io_uring_prep_writev(sqe, fd, iov, off)
                    sqe.flags |= liburing.IOSQE_IO_LINK if off + piece == self.file_size else 0
                    sqe.user_data = i
                sqe = liburing.io_uring_get_sqe(ring)
                liburing.io_uring_prep_fsync(sqe, fd, 0)
                sqe.user_data = i
                left[i] = self.file_size // piece + 1

            following = 0
            while following < self.nfiles and len(left) < depth:
                submit(following)
                following += 1
            liburing.io_uring_submit(ring)
            finished = 0
            while finished < self.nfiles:
                liburing.io_uring_wait_cqe(ring, cqe)
                entry = cqe[0]
                i, res = entry.user_data, entry.res
                liburing.io_uring_cqe_seen(ring, entry)
                if res is not None and res < 0:
                    raise OSError(-res, f"io_uring: {os.strerror(-res)} writing {self._path(i)}")
                left[i] -= 1
                if left[i] == 0:
                    del left[i]
                    os.close(fds.pop(i))
                    finished += 1
                    if following < self.nfiles:
                        submit(following)
                        following += 1
                        liburing.io_uring_submit(ring)
        finally:
            for fd in fds.values():
                os.close(fd)
            liburing.io_uring_queue_exit(ring)

    def check(self, run: Callable[[], None]) -> None:
        """``run`` wrote every file with the bytes it was given."""
        run()
        for i in range(self.nfiles):
            with open(self._path(i), "rb") as f:
                if f.read() != self._piece(i):
                    raise SystemExit(f"{self._path(i)}: the bytes written differ from the bytes given")
        self.clear()

    def clear(self) -> None:
        for name in os.listdir(self.folder):
            os.unlink(self.folder / name)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def variants(engines: Engines, threads: list[int], urings: list[tuple[int, int]]) -> dict[str, Callable[[], None]]:
    found: dict[str, Callable[[], None]] = {"floor": engines.floor}
    for n in threads:
        found[f"threads {n}"] = lambda n=n: engines.threads(n)
    if liburing is not None:
        for depth, piece in urings:
            found[f"io_uring {depth} x {piece >> 20} MiB"] = lambda d=depth, p=piece: engines.uring(d, p)
    return found


def measure(where: Path, data: memoryview, args: argparse.Namespace) -> None:
    folder = Path(tempfile.mkdtemp(prefix="ckptd-write-engines-", dir=where))
    try:
        engines = Engines(data, folder, args.file_size)
        try:
            engines.floor()
        except baselines.DirectIORefused as exc:
            print(f"{where}: {exc}; skipped")
            return
        engines.clear()
        runs = variants(engines, args.threads, args.uring)
        for name, run in runs.items():
            if name != "floor":
                engines.check(run)
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        cpu: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(args.repeat + 1):  # the first round warms up and is not counted
            order = list(runs) if r % 2 else list(runs)[::-1]
            for name in order:
                os.sync()
                c0, t0 = cpu_seconds(), time.perf_counter()
                runs[name]()
                dt, dc = time.perf_counter() - t0, cpu_seconds() - c0
                engines.clear()
                if r:
                    seconds[name].append(dt)
                    cpu[name].append(dc)
        print(f"\n{len(data) >> 20} MiB as {engines.nfiles} files of {args.file_size >> 20} MiB under {where}, "
              f"{args.repeat} repeats")
        print(f"{'variant':24s} {'time':>8s} {'GB/s':>6s} {'CPU s':>7s} {'x floor':>8s}  (floor time / this, per repeat)")
        for name in runs:
            paired = [f / x for f, x in zip(seconds["floor"], seconds[name])]
            t = statistics.median(seconds[name])
            print(f"{name:24s} {t:7.3f}s {len(data) / t / 1e9:6.2f} {statistics.median(cpu[name]):7.3f} "
                  f"{statistics.median(paired):8.2f}  [{' '.join(f'{x:.2f}' for x in paired)}]")
    finally:
        for name in os.listdir(folder):
            os.unlink(folder / name)
        folder.rmdir()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="bytes per repeat (default 1GiB)")
    ap.add_argument("--file-size", default="64MiB", help="bytes per chunk file (default 64MiB, the daemon's)")
    ap.add_argument("--repeat", type=int, default=8, help="measured repeats after one warm-up (default 8)")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="the disk measured (default: temp dir)")
    ap.add_argument("--ramdisk", default="/dev/shm", help="a tmpfs measured too (default /dev/shm); 'none' to skip")
    ap.add_argument("--threads", default="1,2,4", help="thread counts (default 1,2,4)")
    ap.add_argument("--uring", default="2x64MiB,4x16MiB,8x4MiB",
                    help="io_uring variants, DEPTHxPIECE: chunk files in flight x bytes per write")
    args = ap.parse_args(argv)
    args.file_size = parse_size(args.file_size)
    args.threads = [int(x) for x in args.threads.split(",") if x]
    args.uring = [(int(d), parse_size(p)) for d, p in (v.split("x", 1) for v in args.uring.split(",") if v)]
    if liburing is None:
        print("io_uring: the liburing binding is not installed (pip install liburing); threads and the floor only")
    data = Bytes(parse_size(args.size))
    measure(args.dir, data.view, args)
    if args.ramdisk != "none":
        measure(Path(args.ramdisk), data.view, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
