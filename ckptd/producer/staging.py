"""Staging memory: one arena (``Arena``), allocated and pre-faulted once, reused for every snapshot.

``emit`` never allocates: it takes a region at the ring's head, copies into it and hands
it to the sender; regions come back, oldest first, as the daemon acknowledges them. The
arena is a memfd sealed against shrinking, whose descriptor the shared-memory transport
hands to the daemon (``ckptd.transport.handoff``); a large one is pre-faulted by several
threads (``madvise(MADV_POPULATE_WRITE)`` or ``memset``, through ctypes).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import CheckpointError

ALIGN = 64  # every region starts on a cache line, so any dtype view of it is aligned
PAGE = 4096  # large regions start on a page: the daemon writes them with O_DIRECT
LARGE = 2**20
MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14+; Python's mmap module lacks it before 3.13
PREFAULT_SPLIT = 64 * 2**20
PREFAULT_THREADS = 8  # at most; past the memory controller's bandwidth more only contend


@dataclass(eq=False)
class Region:
    """A range of the staging arena that one message's bytes occupy.

    ``seq``: the wire sequence number it travels under; set by the sender"""

    start: int
    nbytes: int
    seq: int = -1


class Arena:
    def __init__(self, size: int) -> None:
        size = max(PAGE, -(-size // PAGE) * PAGE)
        self.fd = _memfd(size)
        threads = _prefault_threads(size)
        # every page is faulted now, not in emit: by MAP_POPULATE, or (large) by threads below
        populate = getattr(mmap, "MAP_POPULATE", 0) if threads <= 1 else 0
        try:
            if self.fd >= 0:
                self._mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | populate)
            else:
                self._mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
            if threads > 1:
                prefault(self._mm, threads)
        except BaseException:
            if self.fd >= 0:
                os.close(self.fd)
            raise
        self.capacity = size
        self._live: deque[Region] = deque()
        self._head = 0
        self._cond = threading.Condition()
        self._broken: str | None = None
        self.blocked_s = 0.0

    def tensor(self) -> Any:
        """The whole arena as one flat uint8 torch tensor (no copy)."""
        import torch

        return torch.frombuffer(self._mm, dtype=torch.uint8)

    def view(self, region: Region) -> memoryview:
        return memoryview(self._mm)[region.start:region.start + region.nbytes]

    def alloc(self, nbytes: int, *, timeout: float, block: bool, what: str,
              on_wait: Callable[[int | None], None] | None = None) -> Region:
        """Take ``nbytes`` (at most ``capacity``), waiting up to ``timeout`` s for space.
        ``on_wait(through)`` runs once before the first wait, outside the arena's lock:
        space comes back only when the daemon has written what was sent, so it asks the
        daemon to write out everything it holds (a chunk it is still filling, too) and
        to give back at once the staging up to seq ``through`` that it keeps to send."""
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes cannot fit an arena of {self.capacity}")
        align = PAGE if nbytes >= LARGE else ALIGN
        deadline: float | None = None
        full_since: float | None = None
        asked = on_wait is None
        with self._cond:
            while True:
                if self._broken:
                    raise CheckpointError(self._broken)
                start = self._fit(nbytes, align)
                if start is not None:
                    region = Region(start, nbytes)
                    self._live.append(region)
                    self._head = start + nbytes
                    if full_since is not None:  # asking the daemon to write out is part of the wait
                        self.blocked_s += time.monotonic() - full_since
                    return region
                full_since = full_since or time.monotonic()
                if not block:
                    raise CheckpointError(
                        f"staging memory is full ({self.capacity} bytes in flight to the daemon) "
                        f"while staging {what}; raise [producer] staging_size, or set on_full = \"block\""
                    )
                if not asked:
                    asked = True
                    assert on_wait is not None
                    through = self._through(nbytes, align)
                    self._cond.release()  # on_wait sends a message: never under the arena's lock
                    try:
                        on_wait(through)
                    finally:
                        self._cond.acquire()
                    continue
                now = time.monotonic()
                deadline = deadline or now + timeout
                if now >= deadline:
                    held = sum(r.nbytes for r in self._live)
                    raise CheckpointError(
                        f"waited {timeout:g} s for staging memory while staging {what}: {held} of the "
                        f"arena's {self.capacity} bytes are still with the daemon, not yet written (a slow "
                        "or stalled disk, a daemon over its memory_budget, or a stalled daemon: its log says "
                        "which); raise [producer] staging_size or emit_timeout"
                    )
                self._cond.wait(deadline - now)

    def try_alloc(self, nbytes: int) -> Region | None:
        """Take ``nbytes``, page-aligned, if they are free now; never waits (a cached save
        plan takes one region for all its tensors, or goes the general way)."""
        with self._cond:
            if self._broken:
                raise CheckpointError(self._broken)
            start = self._fit(nbytes, PAGE) if nbytes <= self.capacity else None
            if start is None:
                return None
            region = Region(start, nbytes)
            self._live.append(region)
            self._head = start + nbytes
            return region

    def _through(self, need: int, align: int) -> int | None:
        """The newest seq whose region must come back for ``need`` bytes to fit (regions
        come back oldest first), or None if none was sent."""
        live, through = deque(self._live), None
        while live:
            region = live.popleft()
            through = region.seq if region.seq >= 0 else through
            if self._fit(need, align, live) is not None:
                break
        return through

    def _fit(self, need: int, align: int, live: deque[Region] | None = None) -> int | None:
        live = self._live if live is None else live
        if not live:
            return 0
        tail = live[0].start
        head = -(-self._head // align) * align
        if self._head > tail:
            if head + need <= self.capacity:
                return head
            return 0 if need <= tail else None
        return head if head + need <= tail else None

    def release_through(self, seq: int) -> None:
        """Give back every region sent under a sequence number up to ``seq``."""
        with self._cond:
            freed = False
            while self._live and 0 <= self._live[0].seq <= seq:
                self._live.popleft()
                freed = True
            if freed:
                self._cond.notify_all()

    def shrink(self, region: Region, nbytes: int) -> None:
        """Give back the unused end of ``region``, if it is the newest region: a batch
        sent before it filled (an eighth of the arena, holding one small tensor between
        two large ones) must not hold what it does not use."""
        nbytes = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._cond:
            if self._live and self._live[-1] is region and nbytes < region.nbytes:
                region.nbytes = nbytes
                self._head = region.start + nbytes
                self._cond.notify_all()

    def release(self, region: Region) -> None:
        """Give back a region that was never sent (its copy failed)."""
        with self._cond:
            try:
                self._live.remove(region)
            except ValueError:
                return
            if self._live:
                last = self._live[-1]
                self._head = last.start + last.nbytes
            self._cond.notify_all()

    def reset(self) -> None:
        """Forget every region (the connection that carried them is gone) and mend a break."""
        with self._cond:
            self._live.clear()
            self._head = 0
            self._broken = None
            self._cond.notify_all()

    def break_(self, message: str) -> None:
        """Make every waiting and future ``alloc`` raise ``message`` until ``reset``."""
        with self._cond:
            self._broken = message
            self._cond.notify_all()

    def close(self) -> None:
        self.break_("the producer is closed")
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self._mm.close()
        except BufferError:
            pass


def _prefault_threads(size: int) -> int:
    if size < PREFAULT_SPLIT or not hasattr(mmap, "MAP_POPULATE"):
        return 1
    return max(1, min(PREFAULT_THREADS, os.cpu_count() or 1, size // (PREFAULT_SPLIT // 2)))


def background_priority() -> None:
    """Give the calling thread, and the threads it starts, the lowest CPU priority (nice
    19): staging made in the background then takes only CPU that nobody else wants. On a
    2-core machine, a 1.3 GiB arena faulted at normal priority right after a job's first
    checkpoint held both cores for 0.4 s, and the daemon's commit of that checkpoint
    waited for it (durable 1.1 s against 0.7 s). Linux nice values are per thread."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def prefault(mm: mmap.mmap, threads: int) -> None:
    """Fault in every page of ``mm`` for writing, ``threads`` ranges at once."""
    size = len(mm)
    buf = (ctypes.c_char * size).from_buffer(mm)
    try:
        base = ctypes.addressof(buf)
        step = -(-size // threads // PAGE) * PAGE
        ranges = [(base + start, min(step, size - start)) for start in range(0, size, step)]
        errors: list[BaseException] = []

        def fault(at: int, n: int) -> None:
            try:
                _populate(at, n)
            except BaseException as exc:
                errors.append(exc)

        workers = [threading.Thread(target=fault, args=r, name="ckptd-prefault", daemon=True) for r in ranges[1:]]
        for w in workers:
            w.start()
        fault(*ranges[0])
        for w in workers:
            w.join()
        if errors:
            raise errors[0]
    finally:
        del buf


_madvise_refused = False


def _populate(at: int, n: int) -> None:
    """Fault in ``n`` bytes at address ``at`` for writing (the GIL released)."""
    global _madvise_refused
    if not _madvise_refused:
        libc = _libc()
        if libc is not None and libc.madvise(at, n, MADV_POPULATE_WRITE) == 0:
            return
        err = ctypes.get_errno() if libc is not None else 0
        if err == 12:  # ENOMEM: no memory for the pages; touching them would only get SIGBUS
            raise MemoryError(f"no memory to fault in {n} bytes of staging; lower [producer] staging_size "
                              "(or staging_limit), or free memory on this node")
        _madvise_refused = True
    ctypes.memset(at, 0, n)


_LIBC: list[Any] = []


def _libc() -> Any:
    if not _LIBC:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            libc = None
        _LIBC.append(libc)
    return _LIBC[0]


def _memfd(size: int) -> int:
    """A sealed memfd of ``size`` bytes, or -1 where the system has none."""
    if not hasattr(os, "memfd_create"):
        return -1
    fd = os.memfd_create("ckptd-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd
