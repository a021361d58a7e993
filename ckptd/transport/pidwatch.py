"""Noticing at once that the process at the other end of an ``ipc://`` socket exited.

Over ``ipc://`` the kernel tells libzmq which process is at the other end
(SO_PEERCRED, the frame property ``Peer-Address`` = ``host:uid:gid:pid``): a pid
neither side can forge, translated into the reader's own pid namespace. Both ends
use it: the daemon to end a dead producer's session (``ckptd.daemon.liveness``), a
producer to fail its steps in flight the moment its daemon dies, instead of after
``timeout`` seconds of silence (which, set short, also fails a daemon that is only
starved of CPU for a moment).

A ``ProcessWatch`` holds a pidfd (Linux >= 5.3), readable once the process exited;
where pidfds are not available it compares the process's start time in
``/proc/<pid>/stat`` when asked (a reused pid has another start time).
"""

from __future__ import annotations

import errno
import os
import select
from typing import Any


def peer_pid(frame: Any) -> int | None:
    """The pid of the process that sent ``frame`` over ipc://, or None."""
    try:
        pid = int(frame.get("Peer-Address").split(":")[-1])
    except Exception:  # no such property (an older libzmq, another transport)
        return None
    return pid if pid > 0 else None


class ProcessWatch:
    """One process, watched for its exit.

    ``fd`` is its pidfd (poll it for readability), or -1 where there is none: then
    ``exited()`` reads /proc. ``watchable`` is False where neither works (a hidden
    /proc, ``ProtectProc=invisible``): no death is ever guessed then."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = -1
        self.start: str | None = None
        self.gone_at_start = False
        try:
            self.fd = os.pidfd_open(pid)
        except OSError as exc:
            if exc.errno == errno.ESRCH:  # gone already
                self.gone_at_start = True
            else:  # ENOSYS, EPERM (a seccomp filter): /proc it is
                self.start = start_time(pid)
        self.why = "" if self.fd >= 0 or self.gone_at_start or self.start is not None else \
            "no pidfd, and /proc does not show it"

    @property
    def watchable(self) -> bool:
        return not self.why

    def exited(self) -> bool:
        """Whether the process has exited (a zombie counts as exited)."""
        if self.gone_at_start:
            return True
        if self.fd >= 0:
            return bool(select.select([self.fd], [], [], 0)[0])
        return self.start is not None and start_time(self.pid) != self.start

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state is field 3
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19] if len(fields) > 19 else None
