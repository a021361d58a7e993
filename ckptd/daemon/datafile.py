"""Writing a data file sequentially, with O_DIRECT where the filesystem allows it.

Measured here (1 GiB, then fsync): buffered writes 0.9-1.4 GB/s, O_DIRECT from
page-aligned memory 2.3-3.1 GB/s, O_DIRECT through an aligned bounce buffer
1.7-1.8 GB/s. So a buffer that starts on a page, at a page-aligned file offset,
goes to the disk as it is (shared staging regions of 1 MiB and more are
page-aligned, and a chunk's data starts on a page); anything else is gathered
into a page-aligned bounce buffer first. The file's last partial block is
written padded, then the file is truncated to its true length.

A filesystem that refuses O_DIRECT (tmpfs, some network filesystems) answers
EINVAL at open or at the first write; the file then carries on buffered, and
the filesystem is not asked again. ``Throttle`` caps the bytes per second, for
``[daemon] write_rate``.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections import deque
from itertools import islice
from typing import Any, Iterable

# fileio.buffer_address imports numpy where it is first called: here, the daemon imports
# it as it starts, not in its first commit (which, at nice 19 on a busy host, took 30 s)
import numpy  # noqa: F401

from ..format.fileio import buffer_address

BLOCK = 4096  # O_DIRECT alignment of addresses, offsets and lengths (the common logical block size)
BOUNCE = 8 * 2**20  # the bounce buffer; measured: 8 MiB writes are as fast as larger ones
_DIRECT_MAX = 64 * 2**20  # largest single O_DIRECT write (the floor's own call size: benchmarks/limits.py)
_IOV_MAX = 1024  # buffers per writev (Linux's IOV_MAX)
_no_direct: set[int] = set()  # st_dev of filesystems that refused O_DIRECT
_no_direct_lock = threading.Lock()


class Throttle:
    """Spread writes so that they average at most ``rate`` bytes per second."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._next = 0.0  # monotonic time at which the bytes granted so far are "paid"
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        if not self.rate or not nbytes:
            return
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now) + nbytes / self.rate
            wait = self._next - now
        if wait > 0:
            time.sleep(wait)


class DataFile:
    """One file written front to back. ``bounce`` is the calling thread's own buffer
    (one per writer thread, allocated once)."""

    def __init__(self, fd: int, *, direct: bool, bounce: "Bounce", throttle: Throttle | None = None) -> None:
        self.fd = fd
        self.size = 0  # bytes of the file, counting what waits in the bounce buffer
        self._bounce = bounce
        self._fill = 0  # bytes waiting in the bounce buffer; the file holds size - fill
        self._tail = b""  # between calls: this file's partial last block (the buffer is the thread's)
        self._error: OSError | None = None
        self._throttle = throttle
        self._queued: list[memoryview] = []  # aligned bytes waiting for one pwritev (write)
        self._queued_bytes = 0
        self._bounce_queued = False  # the bounce buffer's bytes are among them
        self.direct = direct and _direct_allowed(fd)
        if direct and not self.direct:  # opened with O_DIRECT on a filesystem that refused it before
            _clear_direct(fd)

    @classmethod
    def create(cls, path: Any, *, direct: bool, bounce: "Bounce", throttle: Throttle | None = None) -> "DataFile":
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        if direct and hasattr(os, "O_DIRECT"):
            try:
                return cls(os.open(path, flags | os.O_DIRECT, 0o644), direct=True, bounce=bounce, throttle=throttle)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        return cls(os.open(path, flags, 0o644), direct=False, bounce=bounce, throttle=throttle)

    def write(self, buffers: Iterable[Any]) -> None:
        """Write ``buffers`` in order; they may be reused once this returns. Page-aligned
        runs go to the disk as they are, gathered into one ``writev`` of up to
        ``_DIRECT_MAX`` bytes: the kernel then has every one of their requests in
        flight at once. Written one buffer at a time, a 4 MiB tensor was one request
        at a time, and a chunk file's durable time was 0.73-0.82x an O_DIRECT write of
        the same bytes in 64 MiB calls; gathered, 0.94-1.13x (docs/performance.md)."""
        self._claim_bounce()
        try:
            self._write_each(buffers)
            self._flush()  # the caller's buffers are its own again once this returns
        except BaseException:
            self._queued, self._queued_bytes, self._bounce_queued = [], 0, False  # never written later
            raise

    def _write_each(self, buffers: Iterable[Any]) -> None:
        for buf in buffers:
            view = memoryview(buf).cast("B")
            self.size += len(view)
            if not self.direct:
                self._drain()  # bytes left in the bounce buffer (O_DIRECT refused since) come first
                self._write_all(view)
                continue
            while view:
                if self._fill % BLOCK == 0 and len(view) >= BLOCK and buffer_address(view) % BLOCK == 0:
                    # the file offset is block-aligned now, and so is this buffer
                    self._queue_bounce()
                    n = min(len(view) - len(view) % BLOCK, _DIRECT_MAX)
                    self._queue(view[:n])
                    view = view[n:]
                    continue
                if self._bounce_queued:  # its bytes must reach the file before it is refilled
                    self._flush()
                n = min(len(view), len(self._bounce.view) - self._fill)
                self._bounce.view[self._fill:self._fill + n] = view[:n]
                self._fill += n
                view = view[n:]
                if self._fill == len(self._bounce.view):
                    self._drain()

    def _queue_bounce(self) -> None:
        """The bounce buffer's bytes (whole blocks) go out first, in the same call."""
        if self._fill:
            self._queue(self._bounce.view[:self._fill])
            self._fill = 0
            self._bounce_queued = True

    def _queue(self, view: memoryview) -> None:
        """Page-aligned bytes for the next ``writev`` (written once enough are queued)."""
        if self._queued_bytes + len(view) > _DIRECT_MAX or len(self._queued) >= _IOV_MAX:
            self._flush()
        self._queued.append(view)
        self._queued_bytes += len(view)

    def _flush(self) -> None:
        """Write what is queued, in one call where the kernel takes it all."""
        queued, self._queued, self._queued_bytes = self._queued, [], 0
        self._bounce_queued = False
        if queued:
            self._write_all(*queued)

    def _claim_bounce(self) -> None:
        """Take the thread's bounce buffer from the file whose bytes wait in it: that file
        writes its whole blocks and keeps its partial last block aside until its next
        call (two streamed tensors, interleaved, overwrote each other's bytes there)."""
        if self._error is not None:  # a write of this file failed while another file took over
            raise self._error
        owner = self._bounce.owner
        if owner is self:
            return
        if owner is not None:
            try:
                owner._set_aside()
            except OSError as exc:  # that file's failure, raised at its own next call
                owner._error, owner._fill = exc, 0
        self._bounce.owner = self
        if self._tail:
            self._bounce.view[:len(self._tail)] = self._tail
            self._fill, self._tail = len(self._tail), b""

    def _set_aside(self) -> None:
        if self._fill % BLOCK:
            whole = self._fill - self._fill % BLOCK
            self._tail = bytes(self._bounce.view[whole:self._fill])
            self._fill = whole
        self._drain()

    def finish(self) -> int:
        """Write what waits, fix the file's length; return the descriptor (the caller
        fsyncs and closes it)."""
        self._claim_bounce()
        if self._fill:
            tail = self._fill
            padded = -(-tail // BLOCK) * BLOCK
            self._bounce.view[tail:padded] = bytes(padded - tail)
            self._fill = padded
            self._drain()
            os.ftruncate(self.fd, self.size)  # drop the padding of the last block
        return self.fd

    def close(self) -> None:
        if self._bounce.owner is self:  # what waits there is dropped with the file
            self._bounce.owner, self._fill = None, 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _drain(self) -> None:
        """Write the bounce buffer's whole blocks (all of it: callers fill to a block),
        after whatever is queued before them."""
        self._queue_bounce()
        self._flush()

    def _write_all(self, *views: memoryview) -> None:
        """Write ``views`` in order at the file's offset, with as few calls as it takes."""
        pending = deque(v for v in views if len(v))
        while pending:
            try:
                n = os.writev(self.fd, list(islice(pending, _IOV_MAX)))
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                self._refuse_direct()  # (nothing was written: the same again, buffered)
                continue
            if self._throttle is not None:
                self._throttle.take(n)
            while n:  # drop what was written; a short write leaves the rest of a buffer
                head = pending[0]
                if n >= len(head):
                    n -= len(head)
                    pending.popleft()
                else:
                    pending[0], n = head[n:], 0

    def _refuse_direct(self) -> None:
        """This filesystem will not do O_DIRECT: carry on buffered, and remember."""
        _clear_direct(self.fd)
        self.direct = False
        with _no_direct_lock:
            _no_direct.add(os.fstat(self.fd).st_dev)


class Bounce:
    """A page-aligned, pre-faulted buffer for one writer thread."""

    def __init__(self, size: int = BOUNCE) -> None:
        self._mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
        self.view = memoryview(self._mm)
        self.owner: DataFile | None = None  # the file whose bytes wait in it


def _clear_direct(fd: int) -> None:
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


def _direct_allowed(fd: int) -> bool:
    with _no_direct_lock:
        return os.fstat(fd).st_dev not in _no_direct
