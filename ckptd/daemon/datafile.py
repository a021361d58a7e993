"""Writing a data file front to back, with O_DIRECT where the filesystem allows it.

Page-aligned buffers go to the disk as they are, gathered into one ``writev``; the
rest passes through a page-aligned bounce buffer (``Bounce``), and the last partial
block is written padded, then truncated. A filesystem that refuses O_DIRECT is
written buffered from then on. ``Throttle`` caps the bytes per second (``write_rate``).
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

import numpy  # noqa: F401  (fileio needs it: imported at start, not in the first commit)

from ..format.fileio import BLOCK, buffer_address

BOUNCE = 8 * 2**20
_DIRECT_MAX = 128 * 2**20  # a default chunk file (64 MiB and its header) in one call
_IOV_MAX = 1024
_no_direct: set[int] = set()
_no_direct_lock = threading.Lock()


class Throttle:
    """Spread writes so that they average at most ``rate`` bytes per second."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._next = 0.0
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
        self.size = 0
        self._bounce = bounce
        self._fill = 0
        self._tail = b""
        self._error: OSError | None = None
        self._throttle = throttle
        self._queued: list[memoryview] = []
        self._queued_bytes = 0
        self._bounce_queued = False
        self.direct = direct and _direct_allowed(fd)
        if direct and not self.direct:
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
        flight at once (docs/performance.md)."""
        self._claim_bounce()
        try:
            self._write_each(buffers)
            self._flush()
        except BaseException:
            self._queued, self._queued_bytes, self._bounce_queued = [], 0, False
            raise

    def _write_each(self, buffers: Iterable[Any]) -> None:
        for buf in buffers:
            view = memoryview(buf).cast("B")
            self.size += len(view)
            if not self.direct:
                self._drain()
                self._write_all(view)
                continue
            while view:
                if self._fill % BLOCK == 0 and len(view) >= BLOCK and buffer_address(view) % BLOCK == 0:
                    self._queue_bounce()
                    n = min(len(view) - len(view) % BLOCK, _DIRECT_MAX)
                    self._queue(view[:n])
                    view = view[n:]
                    continue
                if self._bounce_queued:
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
        if self._error is not None:
            raise self._error
        owner = self._bounce.owner
        if owner is self:
            return
        if owner is not None:
            try:
                owner._set_aside()
            except OSError as exc:
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
        """Write what waits, fix the file's length; return the descriptor (the caller fsyncs and closes it)."""
        self._claim_bounce()
        if self._fill:
            tail = self._fill
            padded = -(-tail // BLOCK) * BLOCK
            self._bounce.view[tail:padded] = bytes(padded - tail)
            self._fill = padded
            self._drain()
            os.ftruncate(self.fd, self.size)
        return self.fd

    def close(self) -> None:
        if self._bounce.owner is self:
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
                self._refuse_direct()
                continue
            if self._throttle is not None:
                self._throttle.take(n)
            while n:
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


class OffsetFile:
    """One file written at offsets from several threads at once (``os.pwritev``): whole
    blocks of page-aligned memory at block offsets with O_DIRECT where the filesystem
    allows it, the rest (a header, a last partial block, unaligned memory) through the
    page cache; the fsync of ``finish``'s descriptor covers both."""

    def __init__(self, path: Any, *, direct: bool, throttle: Throttle | None = None) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = os.open(path, flags, 0o644)
        self.direct_fd = -1
        self._throttle = throttle
        self._direct = False
        if direct and hasattr(os, "O_DIRECT") and _direct_allowed(self.fd):
            try:
                self.direct_fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT)
                self._direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    self.close()
                    raise

    def write_at(self, buf: Any, offset: int) -> None:
        view = memoryview(buf).cast("B")
        whole = 0
        if self._direct and offset % BLOCK == 0 and buffer_address(view) % BLOCK == 0:
            whole = len(view) - len(view) % BLOCK
        done = 0
        while done < whole:
            try:
                done += self._pwrite(self.direct_fd, view[done:min(whole, done + _DIRECT_MAX)], offset + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct = False
                with _no_direct_lock:
                    _no_direct.add(os.fstat(self.fd).st_dev)
                break
        while done < len(view):
            done += self._pwrite(self.fd, view[done:done + _DIRECT_MAX], offset + done)

    def _pwrite(self, fd: int, view: memoryview, offset: int) -> int:
        n = os.pwritev(fd, [view], offset)
        if self._throttle is not None:
            self._throttle.take(n)
        return n

    def finish(self) -> int:
        """The descriptor to fsync and close (every piece written)."""
        if self.direct_fd >= 0:
            os.close(self.direct_fd)
            self.direct_fd = -1
        return self.fd

    def close(self) -> None:
        for fd in (self.direct_fd, self.fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.direct_fd = -1


class Bounce:
    """A page-aligned, pre-faulted buffer for one writer thread."""

    def __init__(self, size: int = BOUNCE) -> None:
        self._mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
        self.view = memoryview(self._mm)
        self.owner: DataFile | None = None


def _clear_direct(fd: int) -> None:
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


def _direct_allowed(fd: int) -> bool:
    with _no_direct_lock:
        return os.fstat(fd).st_dev not in _no_direct
