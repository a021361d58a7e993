"""File I/O that every format's writing and reading shares: vectored writes, reads
until a buffer is full, a buffer's address (O_DIRECT wants it page-aligned)."""

from __future__ import annotations

import os
from collections import deque
from typing import Any, Sequence

BLOCK = 4096  # O_DIRECT alignment of addresses, offsets and lengths (the common logical block size)
_IOV_MAX = 1024


def buffer_address(view: memoryview) -> int:
    """The address of a buffer's first byte (O_DIRECT wants it page-aligned)."""
    import numpy as np

    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def write_buffers(fd: int, buffers: Sequence[Any]) -> None:
    """Write every buffer in order with as few syscalls as the kernel allows."""
    pending = deque(v for b in buffers if len(v := memoryview(b).cast("B")))
    while pending:
        batch = [pending[i] for i in range(min(len(pending), _IOV_MAX))]
        n = os.writev(fd, batch)
        while n and pending:
            head = pending[0]
            if n >= len(head):
                n -= len(head)
                pending.popleft()
            else:
                pending[0] = head[n:]
                n = 0


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` from ``offset`` until it is full or the file ends; the bytes read."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done
