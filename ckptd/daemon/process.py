"""What the daemon process sets up for itself before it serves: its priority, how
glibc keeps freed memory, and the per-host lock on its root."""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
from pathlib import Path

from ..errors import CheckpointError


def lower_priority(nice: int) -> None:
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if nice > current:
        os.nice(nice - current)


def keep_freed_memory() -> None:
    """Ask glibc to keep freed receive buffers instead of unmapping them.

    libzmq mallocs a buffer per received message; by default glibc returns
    buffers over 32 MiB (and trims the heap) to the kernel on free, and the next
    checkpoint faults every page back in, which costs more than receiving the
    bytes. Memory the daemon holds stays bounded by ``memory_budget``.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    libc.mallopt(m_mmap_threshold, 32 * 2**20)
    libc.mallopt(m_trim_threshold, 2**31 - 1)
    libc.mallopt(m_arena_max, 2)


def lock_root(root: Path) -> int:
    """Lock ``root`` for this host's daemon; return the lock's descriptor (held until exit)."""
    # One daemon per root and host: a second one here would take the first's files
    # for a crash's leftovers. Daemons of other hosts (shared storage) coexist.
    path = root / f".ckptd-{socket.gethostname()}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise CheckpointError(
            f"another ckptd daemon (pid {other or '?'}) is already serving {root}"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
