"""Durable file operations. ``replacing`` is the one way ckptd commits a file;
``atomic_write`` is it for bytes in memory."""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


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
    with replacing(path, fsync=fsync) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            write_all(fd, data)
        finally:
            os.close(fd)


@contextmanager
def replacing(path: str | os.PathLike[str], *, fsync: bool = True) -> Iterator[Path]:
    """Yield a temp path beside ``path`` for the caller to write (a library that wants a
    path, such as ``torch.save``); on success it replaces ``path`` as ``atomic_write``
    does (fsync, rename, fsync the folder); on an exception it is removed."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        yield tmp
        if fsync:
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


def temp_path(path: Path) -> Path:
    """The temporary file beside ``path`` that ``replacing`` writes: unique per writer, as
    daemons of several hosts may replace one file on shared storage."""
    return path.with_name(f".{path.name}~{socket.gethostname()}-{os.getpid()}.tmp")


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """``os.write`` until every byte is written (regular files may write short)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]
