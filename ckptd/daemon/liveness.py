"""Noticing at once that a local producer's process died.

Over ``ipc://`` the kernel tells libzmq which process connected (SO_PEERCRED, the
frame property ``Peer-Address`` = ``host:uid:gid:pid``): a pid the producer cannot
forge, in the daemon's own pid namespace. The daemon opens a pidfd on it
(Linux >= 5.3), which becomes readable when that process exits; every pidfd sits
in one epoll set whose descriptor the main loop polls, so a death wakes the loop.
Where pidfds are not available the process's start time in ``/proc/<pid>/stat`` is
compared once a second instead (a reused pid has another start time).

A dead producer's last messages may still be on their way through libzmq's I/O
thread (a commit sent just before it died must still be committed), so its session
ends only once it has been dead and silent for ``GRACE_S`` while the daemon reads.
``tcp://`` producers have no pid the daemon can trust: the session timeout applies.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("ckptd.daemon")
GRACE_S = 0.5  # dead, and nothing heard from it for this long: its messages have all been read
_PROC_CHECK_S = 1.0


def peer_pid(frame: Any) -> int | None:
    """The pid of the process that connected over ipc:// and sent ``frame``, or None."""
    try:
        pid = int(frame.get("Peer-Address").split(":")[-1])
    except Exception:  # no such property (an older libzmq, another transport)
        return None
    return pid if pid > 0 else None


@dataclass
class _Watched:
    pid: int
    fd: int = -1  # its pidfd, or -1: compared by start time instead
    start: str | None = None  # /proc/<pid>/stat field 22, where no pidfd
    died: float | None = None  # monotonic time its death was noticed


class Liveness:
    """The pids of local producers, by session identity, and which of them died."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._by_id: dict[bytes, _Watched] = {}
        self._by_fd: dict[int, bytes] = {}
        self._next_proc_check = 0.0

    def fileno(self) -> int:
        """Readable when a watched process has exited."""
        return self._epoll.fileno()

    def watch(self, identity: bytes, pid: int) -> None:
        self.forget(identity)
        w = _Watched(pid)
        try:
            w.fd = os.pidfd_open(pid)
        except OSError as exc:
            if exc.errno == errno.ESRCH:  # gone already: its hello was its last word
                w.died = time.monotonic()
            else:  # ENOSYS, EPERM (a seccomp filter): /proc it is
                w.start = _start_time(pid)
                if w.start is None:  # hidden (ProtectProc=invisible): no death is ever guessed
                    log.debug("cannot watch pid %d (%s, and /proc does not show it): session_timeout applies",
                              pid, exc.strerror)
                    return
        else:
            self._epoll.register(w.fd, select.EPOLLIN)
            self._by_fd[w.fd] = identity
        self._by_id[identity] = w

    def forget(self, identity: bytes) -> None:
        w = self._by_id.pop(identity, None)
        if w is not None and w.fd >= 0:
            self._by_fd.pop(w.fd, None)
            self._epoll.unregister(w.fd)
            os.close(w.fd)

    def pending(self) -> bool:
        """Whether a death was noticed whose session has not ended yet."""
        return any(w.died is not None for w in self._by_id.values())

    def ended(self, now: float, last_seen: Callable[[bytes], float]) -> list[tuple[bytes, int]]:
        """(identity, pid) of producers dead and silent for GRACE_S: end their sessions
        (then ``forget`` them). ``last_seen``: when a session's last message came."""
        self._notice(now)
        return [(identity, w.pid) for identity, w in self._by_id.items()
                if w.died is not None and now - max(w.died, last_seen(identity)) >= GRACE_S]

    def _notice(self, now: float) -> None:
        for fd, _ in self._epoll.poll(0):
            identity = self._by_fd.get(fd)
            if identity is not None and self._by_id[identity].died is None:
                self._by_id[identity].died = now
        if now >= self._next_proc_check:
            self._next_proc_check = now + _PROC_CHECK_S
            for w in self._by_id.values():
                if w.fd < 0 and w.died is None and _start_time(w.pid) != w.start:
                    w.died = now

    def close(self) -> None:
        for identity in list(self._by_id):
            self.forget(identity)
        self._epoll.close()


def _start_time(pid: int) -> str | None:
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
