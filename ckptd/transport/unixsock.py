"""Unix socket files a daemon binds: refuse one that is alive, remove only its own.

Binding an ``ipc://`` path replaces whatever socket file is there, which would cut a
running daemon off from its producers. ``claim`` connects first: an answer refuses the
bind, a refused connection is a dead daemon's leftover. ``remove`` unlinks the path only
while it is still the inode this process bound.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class BoundSocket:
    """A socket file this process made: removed only while it is still the same file.

    ``ident``: (st_dev, st_ino) right after the bind"""

    path: str
    ident: tuple[int, int]

    @classmethod
    def of(cls, path: str) -> "BoundSocket":
        st = os.stat(path)
        return cls(path, (st.st_dev, st.st_ino))

    def remove(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self.ident:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def in_use(path: str, kind: int = socket.SOCK_STREAM) -> bool:
    """True if a process accepts connections on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        except socket.timeout:
            return True  # a listener whose backlog is full is still a listener
        except OSError as exc:
            if exc.errno in (errno.ENOTSOCK, errno.EPROTOTYPE):
                return False
            raise
        return True


def refuse_if_served(path: str, kind: int, what: str) -> None:
    """Raise ``OSError(EADDRINUSE)`` naming ``what`` if somebody serves at ``path``."""
    if in_use(path, kind):
        raise OSError(errno.EADDRINUSE, f"another process already serves {what} at {path}")
