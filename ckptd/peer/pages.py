"""Memory for bytes arriving from a peer, its pages faulted in ahead of them: a fresh
buffer's first write to each page traps, which on a virtual machine costs as much as the
transfer itself; ``Prefault`` calls ``madvise(MADV_POPULATE_WRITE)`` on a thread of its
own, ahead of the receive. Where the call is missing, pages fault as they are written.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from typing import Any

MADV_POPULATE_WRITE = 23
PAGE = mmap.PAGESIZE


def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


_MADVISE = _madvise()


def populate(view: memoryview) -> bool:
    """Fault in the whole pages of writable ``view`` (its contents unchanged); False
    where the kernel cannot (the pages then fault as they are written)."""
    if _MADVISE is None or len(view) < PAGE:
        return _MADVISE is not None
    addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
    begin, end = -(-addr // PAGE) * PAGE, (addr + len(view)) // PAGE * PAGE
    return end <= begin or _MADVISE(begin, end - begin, MADV_POPULATE_WRITE) == 0  # ctypes drops the GIL


class Prefault:
    """Faults in ``views`` in order, ``chunk`` bytes at a time, on a thread of its own,
    while the caller writes them in the same order; stops at ``close`` or at the first
    range the kernel refuses."""

    def __init__(self, views: list[memoryview], chunk: int) -> None:
        self._views = views
        self._chunk = chunk
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptd-peer-prefault", daemon=True)
        if _MADVISE is not None:
            self._thread.start()

    def _run(self) -> None:
        for view in self._views:
            for off in range(0, len(view), self._chunk):
                if self._stop.is_set() or not populate(view[off:off + self._chunk]):
                    return

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._views = []
