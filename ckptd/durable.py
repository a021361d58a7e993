"""Durable file operations. ``atomic_write`` is the one way ckptd commits a file."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a directory's entries (creations, renames, unlinks) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new file, never
    a part: write a temp file beside it, fsync it, rename it over, fsync the folder."""
    path = Path(path)
    # unique per writer: daemons of several hosts may replace the same file (a run's
    # latest pointer on shared storage)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}-{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        write_all(fd, data)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until every byte is written (regular files may write short)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]
